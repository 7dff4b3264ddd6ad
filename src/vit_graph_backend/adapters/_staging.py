"""Host metadata on its way to the GPU, without a host sync: one pinned block per dtype and call.

A packed call's metadata (rotary positions, segment lengths, window indices) is built on the host
from Python ints. Copied to the GPU as plain (pageable) tensors, every copy synchronizes the
stream: the host waits for all earlier GPU work before each one, so it can never run ahead of a
busy GPU, and a call pays one wait per buffer. Staged in pinned memory, the copies are
asynchronous.

- :class:`HostStage` pads each buffer to its static buffer's full shape once, the tail zeroed on
  the host, in plain memory that later calls with the same grids reuse; each call gets a pinned
  copy of it (one host copy per dtype), so the runtime's ``copy_padded`` (``replay_io.py``)
  makes one asynchronous copy per buffer and no device-side zeroing.
- :func:`upload` makes one asynchronous copy per dtype (eager batches; capture inputs). With
  ``blocks=True`` the values stay views of one device block per dtype, each block also returned
  as a buffer of its own (:func:`block_key`): the static metadata buffers of a captured budget.
  A stage padded to the same shapes has the same :attr:`HostStage.layout`, and
  ``HostStage.pinned(device, whole=True)`` hands over its blocks whole: the runtime then fills
  every metadata buffer of the budget with one copy per dtype instead of one per buffer.

Every call gets its own pinned blocks, so concurrent calls share nothing (a stage is never written
after it is made). The caller never writes a pinned block again; PyTorch's pinned-memory
allocator keeps a freed block until the copies from it have run, so dropping the host tensors
right after the copy is safe. If pinned memory cannot be had, the plain host tensors are used
(the copies then synchronize, as before).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import torch

from ..errors import UnsupportedGraphError

__all__ = ["HostStage", "Layout", "block_key", "layout_of", "upload"]

log = logging.getLogger(__name__)

Shape = Sequence[int]


#: A block's layout: per dtype, in order, the keys and shapes of the views it holds.
Layout = tuple[tuple[torch.dtype, tuple[tuple[str, tuple[int, ...]], ...]], ...]


def block_key(dtype: torch.dtype) -> str:
    """The key under which :func:`upload` (``blocks=True``) and :meth:`HostStage.pinned` give
    the whole block of ``dtype`` (no capture input of the adapters has such a name)."""
    return "block:" + str(dtype).removeprefix("torch.")


def layout_of(blocks: list[tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> Layout:
    """The layout of blocks made by :func:`_blocks`."""
    return tuple((block.dtype, tuple((key, tuple(view.shape)) for key, view in views.items()))
                 for block, views in blocks)


def _blocks(values: Mapping[str, torch.Tensor], shapes: Mapping[str, Shape], pin: bool
            ) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """One block per dtype holding every value in a view of its target shape, zero-padded."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for key, value in values.items():
        by_dtype.setdefault(value.dtype, []).append(key)
    blocks = []
    for dtype, keys in by_dtype.items():
        sizes = [math.prod(shapes[key]) for key in keys]
        block = torch.empty(sum(sizes), dtype=dtype, pin_memory=pin)
        views, start = {}, 0
        for key, size in zip(keys, sizes):
            view = block[start:start + size].view(tuple(shapes[key]))
            value, start = values[key], start + size
            rows = value.shape[0]  # metadata buffers have a row dimension
            if value.shape[1:] != view.shape[1:] or rows > view.shape[0]:
                raise UnsupportedGraphError(
                    f"buffer {key!r} of shape {tuple(value.shape)} does not fit the captured "
                    f"shape {tuple(view.shape)}")
            view[:rows].copy_(value)
            view[rows:].zero_()  # empty when the value fills the shape
            views[key] = view
        blocks.append((block, views))
    return blocks


def _pinned_blocks(values: Mapping[str, torch.Tensor], shapes: Mapping[str, Shape]
                   ) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    try:
        return _blocks(values, shapes, pin=True)
    except UnsupportedGraphError:  # a RuntimeError too, but about the values, not the memory
        raise
    except RuntimeError as exc:  # no pinned memory to be had: plain host tensors still work
        _warn_unpinned(exc)
        return _blocks(values, shapes, pin=False)


def _warn_unpinned(exc: BaseException) -> None:
    log.warning("vitgraph: pinned host memory unavailable (%s); metadata copies wait for the GPU",
                str(exc).split("\n")[0])


class HostStage:
    """Values zero-padded to their shapes once, in plain host memory, for reuse by many calls:
    :meth:`pinned` gives each call its own pinned copy (one host copy per dtype), so staging a
    batch never allocates pinned memory that stays held (a fresh pinned allocation costs
    about a millisecond; the allocator recycles the per-call blocks once their copies ran).

    Raises:
        UnsupportedGraphError: a value longer than its shape, or of other trailing dims.
    """

    def __init__(self, values: Mapping[str, torch.Tensor], shapes: Mapping[str, Shape]) -> None:
        self._blocks = _blocks(values, shapes, pin=False)
        #: per dtype, the keys and shapes of the views (compare with the static blocks')
        self.layout = layout_of(self._blocks)

    def pinned(self, device: torch.device, whole: bool = False) -> dict[str, torch.Tensor]:
        """The values in pinned memory when ``device`` is a GPU, else the staged ones (never
        written: the runtime only copies from them). ``whole``: the blocks themselves, under
        :func:`block_key`, in place of the views: one copy per dtype, into static buffers that
        are views of blocks of the same :attr:`layout` (``upload(..., blocks=True)``)."""
        if device.type != "cuda":
            if whole:
                return {block_key(block.dtype): block for block, _ in self._blocks}
            return {key: view for _, views in self._blocks for key, view in views.items()}
        result = {}
        for block, views in self._blocks:
            try:
                copy = torch.empty(block.shape, dtype=block.dtype, pin_memory=True)
            except RuntimeError as exc:  # no pinned memory: the copies then synchronize
                _warn_unpinned(exc)
                copy = block.clone()
            copy.copy_(block)
            if whole:
                result[block_key(block.dtype)] = copy
            else:
                result.update(_views_like(copy, views))
        return result


def upload(values: Mapping[str, torch.Tensor], device: torch.device, blocks: bool = False
           ) -> dict[str, torch.Tensor]:
    """``values`` (host tensors) on ``device``: one asynchronous copy per dtype on CUDA.

    ``blocks``: the values are views of one new block per dtype, also returned under
    :func:`block_key` (static buffers that a replay fills with one copy per dtype)."""
    device = torch.device(device)
    if device.type != "cuda" and not blocks:
        return {key: value.to(device) for key, value in values.items()}
    shapes = {key: value.shape for key, value in values.items()}
    result = {}
    made = _pinned_blocks(values, shapes) if device.type == "cuda" else _blocks(values, shapes,
                                                                                pin=False)
    for block, views in made:
        on_device = block.to(device, non_blocking=block.is_pinned())
        if blocks:
            result[block_key(block.dtype)] = on_device
        result.update(_views_like(on_device, views))
    return result


def _views_like(block: torch.Tensor, views: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same views as ``views`` (back to back in a block of their own), into ``block``."""
    result, start = {}, 0
    for key, view in views.items():
        result[key] = block[start:start + view.numel()].view(view.shape)
        start += view.numel()
    return result
