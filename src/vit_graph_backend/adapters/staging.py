"""Host metadata on its way to the GPU without a host sync: one byte block per batch.

Copies from pageable host memory synchronize the stream, so the host could never run ahead of a
busy GPU; from pinned memory they are asynchronous. A batch's buffers live in one block of bytes,
each a typed view at a 16-byte aligned offset (:data:`Layout`), so a batch moves in one copy.

- :class:`HostStage` pads each buffer to its static shape once, in plain memory later calls reuse;
  :meth:`~HostStage.on_device` makes the GPU record a batch keeps (``packing``),
  :meth:`~HostStage.pinned` a per-call pinned copy.
- :func:`upload` makes one asynchronous copy; with ``blocks=True`` the values are views of the
  device block, also returned under :data:`BLOCK`, which a replay of the same layout fills at once.

A stage is never written after it is made, so threads share it. PyTorch's pinned allocator keeps a
freed block until its copies ran. Without pinned memory the plain tensors are used.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import torch

from ..errors import UnsupportedGraphError

__all__ = ["BLOCK", "HostStage", "Layout", "layout_of", "upload", "views_of"]

log = logging.getLogger(__name__)

Shape = Sequence[int]

#: The key under which :func:`upload` (``blocks=True``) and :meth:`HostStage.pinned` (``whole``)
#: give the whole block (no capture input of the adapters has this name).
BLOCK = "block"

#: Byte alignment of each view in a block (a multiple of every dtype's element size, and what
#: vectorized kernels reading the views expect).
_ALIGN = 16

#: A block's layout: per buffer, in order, its key, dtype, shape and byte offset.
Layout = tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]


def layout_of(values: Mapping[str, torch.Tensor], shapes: Mapping[str, Shape]
              ) -> tuple[Layout, int]:
    """Where each of ``values``, padded to ``shapes``, lies in one block; and its byte size.

    Raises:
        UnsupportedGraphError: a value longer than its shape, or of other trailing dims.
    """
    layout, offset = [], 0
    for key, value in values.items():
        shape = tuple(shapes[key])
        if tuple(value.shape[1:]) != shape[1:] or value.shape[0] > shape[0]:
            raise UnsupportedGraphError(
                f"buffer {key!r} of shape {tuple(value.shape)} does not fit the captured "
                f"shape {shape}")
        layout.append((key, value.dtype, shape, offset))
        nbytes = math.prod(shape) * value.element_size()
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return tuple(layout), offset


def views_of(block: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """The typed buffers of ``layout`` as views into ``block`` (bytes)."""
    result = {}
    for key, dtype, shape, offset in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        result[key] = block[offset:offset + nbytes].view(dtype).view(shape)
    return result


#: Elements of one host copy that PyTorch runs on the calling thread: above it
#: (``at::internal::GRAIN_SIZE``) the copy wakes the intra-op threads, which costs far more.
_ONE_THREAD = 32768


def _block(values: Mapping[str, torch.Tensor], layout: Layout, nbytes: int) -> torch.Tensor:
    """A block of ``layout`` in plain host memory holding ``values``, each zero-padded."""
    block = torch.empty(nbytes, dtype=torch.uint8)
    for key, view in views_of(block, layout).items():
        rows = values[key].shape[0]  # metadata buffers have a row dimension
        view[:rows].copy_(values[key])
        view[rows:].zero_()  # empty when the value fills the shape
    return block


def _pinned_copy(block: torch.Tensor) -> torch.Tensor:
    """``block`` copied into pinned memory (a plain copy if none), in single-thread pieces."""
    try:
        copy = torch.empty(block.shape, dtype=block.dtype, pin_memory=True)
    except RuntimeError as exc:  # no pinned memory: the copies then synchronize
        log.warning("vitgraph: pinned host memory unavailable (%s); metadata copies wait for "
                    "the GPU", str(exc).split("\n")[0])
        return block.clone()
    words, source = copy.view(torch.int64), block.view(torch.int64)
    for start in range(0, words.numel(), _ONE_THREAD):
        words[start:start + _ONE_THREAD].copy_(source[start:start + _ONE_THREAD])
    return copy


class HostStage:
    """Values zero-padded to their shapes once, in one block of plain host memory, for reuse;
    :meth:`pinned` copies are per call and recycled by the allocator (no pinned memory stays
    held). Raises ``UnsupportedGraphError`` as :func:`layout_of` does."""

    def __init__(self, values: Mapping[str, torch.Tensor], shapes: Mapping[str, Shape]) -> None:
        self.layout, self.nbytes = layout_of(values, shapes)
        self._block = _block(values, self.layout, self.nbytes)

    def views(self, block: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The buffers as views into ``block`` (a copy of this stage's), or into the stage."""
        return views_of(self._block if block is None else block, self.layout)

    def on_device(self, device: torch.device) -> torch.Tensor:
        """A copy of the block on ``device`` (through pinned memory: no host sync)."""
        return _pinned_copy(self._block).to(device, non_blocking=True)

    def pinned(self, device: torch.device, whole: bool = False) -> dict[str, torch.Tensor]:
        """The values in pinned memory on a GPU, else the staged ones (only read). ``whole``: the
        block under :data:`BLOCK` instead of views (for static buffers of the same layout)."""
        block = _pinned_copy(self._block) if device.type == "cuda" else self._block
        return {BLOCK: block} if whole else self.views(block)


def upload(values: Mapping[str, torch.Tensor], device: torch.device, blocks: bool = False
           ) -> dict[str, torch.Tensor]:
    """``values`` (host tensors by key) on ``device``: one asynchronous copy on CUDA. ``blocks``:
    make the values views of one new block, also returned under :data:`BLOCK`."""
    device = torch.device(device)
    if device.type != "cuda" and not blocks:
        return {key: value.to(device) for key, value in values.items()}
    stage = HostStage(values, {key: value.shape for key, value in values.items()})
    block = stage.on_device(device) if device.type == "cuda" else stage._block.to(device)
    result = stage.views(block)
    if blocks:
        result[BLOCK] = block
    return result
