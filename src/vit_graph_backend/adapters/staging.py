"""Host metadata on its way to the GPU, without a host sync: one byte block per batch.

A packed call's metadata (rotary positions, segment lengths, window indices) is built on the host
from Python ints. Copied to the GPU as plain (pageable) tensors, every copy synchronizes the
stream: the host waits for all earlier GPU work before each one, so it can never run ahead of a
busy GPU, and a call pays one wait per buffer. Staged in pinned memory, the copies are
asynchronous.

All buffers of a batch live in **one block of bytes**, each a typed view at a 16-byte aligned
offset (:data:`Layout`), so that a whole batch moves with one copy whatever its dtypes:

- :class:`HostStage` pads each buffer to its static buffer's full shape once, the tail zeroed on
  the host, in plain memory that later calls with the same grids reuse.
  :meth:`HostStage.on_device` puts a copy of the block on the GPU (made once per batch, through a
  pinned block: the adapters keep it as the batch's record, ``_qwen_packing.py``), and
  :meth:`HostStage.pinned` gives a call a pinned copy of its own (where no GPU record is kept).
- :func:`upload` makes one asynchronous copy (eager batches; capture inputs). With
  ``blocks=True`` the values stay views of the device block, which is also returned as a buffer of
  its own under :data:`BLOCK`: the static metadata buffers of a captured budget. A stage padded to
  the same shapes has the same :attr:`HostStage.layout`, and a replay then fills every metadata
  buffer of the budget with one copy of its block (a device-to-device copy from the batch's
  record, no host memory and no allocation on the hot path).

A stage is never written after it is made, so calls on any thread share it safely. The caller
never writes a pinned block again; PyTorch's pinned-memory allocator keeps a freed block until the
copies from it have run, so dropping the host tensors right after the copy is safe. If pinned
memory cannot be had, the plain host tensors are used (the copies then synchronize, as before).
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


#: Elements of one host copy that PyTorch runs on the calling thread: above it a CPU copy is
#: split over the intra-op threads (``at::internal::GRAIN_SIZE``), and waking them cost an H100
#: machine's host about 0.7 ms per staged batch, many times the copy itself
#: (``benchmarks/results/packed_call_host_time_device_metadata_records_*``).
_ONE_THREAD = 32768


def _block(values: Mapping[str, torch.Tensor], layout: Layout, nbytes: int) -> torch.Tensor:
    """A block of ``layout`` in plain host memory holding ``values``, each zero-padded to its
    shape. (Typed copies, as many elements as before the block was counted in bytes: under
    cProfile this took about 0.1 ms per staged batch, no thread wake-ups showing.)"""
    block = torch.empty(nbytes, dtype=torch.uint8)
    for key, view in views_of(block, layout).items():
        rows = values[key].shape[0]  # metadata buffers have a row dimension
        view[:rows].copy_(values[key])
        view[rows:].zero_()  # empty when the value fills the shape
    return block


def _pinned_copy(block: torch.Tensor) -> torch.Tensor:
    """``block`` (bytes, a multiple of 16 long) copied into pinned memory (a plain copy if none
    can be had), as 8-byte words in pieces that each run on the calling thread."""
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
    """Values zero-padded to their shapes once, in one block of plain host memory, for reuse by
    many calls: :meth:`on_device` makes a GPU copy to keep, :meth:`pinned` a pinned copy per
    call (so staging a batch never allocates pinned memory that stays held: a fresh pinned
    allocation costs about a millisecond; the allocator recycles the per-call blocks once their
    copies ran).

    Raises:
        UnsupportedGraphError: a value longer than its shape, or of other trailing dims.
    """

    def __init__(self, values: Mapping[str, torch.Tensor], shapes: Mapping[str, Shape]) -> None:
        #: each buffer's key, dtype, shape and byte offset (compare with the static block's)
        self.layout, self.nbytes = layout_of(values, shapes)
        self._block = _block(values, self.layout, self.nbytes)

    def views(self, block: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The buffers as views into ``block`` (a copy of this stage's), or into the stage."""
        return views_of(self._block if block is None else block, self.layout)

    def on_device(self, device: torch.device) -> torch.Tensor:
        """A copy of the block on ``device``, copied without a host sync (through pinned
        memory) on the current stream."""
        return _pinned_copy(self._block).to(device, non_blocking=True)

    def pinned(self, device: torch.device, whole: bool = False) -> dict[str, torch.Tensor]:
        """The values in pinned memory when ``device`` is a GPU, else the staged ones (never
        written: the runtime only copies from them). ``whole``: the block itself, under
        :data:`BLOCK`, in place of the views: one copy, into static buffers that are views of a
        block of the same :attr:`layout` (``upload(..., blocks=True)``)."""
        block = _pinned_copy(self._block) if device.type == "cuda" else self._block
        return {BLOCK: block} if whole else self.views(block)


def upload(values: Mapping[str, torch.Tensor], device: torch.device, blocks: bool = False
           ) -> dict[str, torch.Tensor]:
    """``values`` (host tensors) on ``device``: one asynchronous copy on CUDA.

    ``blocks``: the values are views of one new block, also returned under :data:`BLOCK` (static
    buffers that a replay fills with one copy)."""
    device = torch.device(device)
    if device.type != "cuda" and not blocks:
        return {key: value.to(device) for key, value in values.items()}
    stage = HostStage(values, {key: value.shape for key, value in values.items()})
    block = stage.on_device(device) if device.type == "cuda" else stage._block.to(device)
    result = stage.views(block)
    if blocks:
        result[BLOCK] = block
    return result
