"""How a Qwen-VL adapter lays out a batch: checked inputs, packed metadata, static buffers and
attention segments, with no knowledge of the blocks that read them.

One of the adapter's three parts (``qwen``, ``kernel_choices``). Replay metadata depends only on
the call's grids, the batch's items and the budget, so it is staged once per batch (``staging``)
and kept, on the GPU where there is room: a repeated batch loads it with one device-to-device
copy. How padding works: ``metadata``.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .._compat import current_raw_stream
from ..budgets import capture_layout, ceil_div
from ..errors import UnsupportedGraphError
from ..protocol import StampedBuffers
from ..specs import EncoderItemSpec
from ..kernels.packed_attention import Segments
from .inputs import PackedCall, PackedInputs, check_packed_inputs
from .metadata import (Grid, MetadataCache, PackedMetadata, QwenLayout, SegmentSlots,
                       pack_metadata, segment_slots)
from .staging import BLOCK, HostStage, Layout, layout_of, upload

__all__ = ["ROW_INDEX", "QwenPacker"]

log = logging.getLogger(__name__)

#: Batches whose staged replay inputs a packer keeps (:class:`QwenPacker.replay_values`).
STAGED_BATCHES = 128
#: GPU bytes the kept batches' device records may hold together (least recent dropped first).
STAGED_DEVICE_BYTES = 64 << 20
#: The static buffer of window-order towers that gathers the graph's input rows.
ROW_INDEX = "row_index"

#: Specs kept by grid (serving streams repeat image sizes); the table is emptied when full.
KEPT_SPECS = 4096


@dataclass(frozen=True, eq=False)
class _Staged:
    """One batch's replay inputs, never written after they are made (earlier copies from them
    may still be in flight). Also the batch's stamp (``protocol.StampedBuffers``): the runtime
    skips the metadata copies when the static buffers were last filled from it."""

    #: the metadata, padded to the budget's captured shapes
    stage: HostStage
    #: the items' source pixel rows as ``(start, count)`` ranges, adjacent ones merged
    parts: tuple[tuple[int, int], ...]
    #: the captured shapes they were padded to (a budget captured again gets new ones)
    shapes: Mapping[str, torch.Size]
    #: the stage's block has the static block's layout (loaded whole)
    whole: bool
    device: torch.device
    #: the stage's block on the GPU, kept with the batch; ``None`` off the GPU or without room
    record: torch.Tensor | None = None
    #: the raw handle of the stream the record was made on
    stream: int | None = None

    def load(self) -> dict[str, torch.Tensor]:
        """The metadata to copy into the static buffers: the block under ``BLOCK`` when the
        layouts match, else the buffers one by one."""
        record = self.record
        if record is None:
            return self.stage.pinned(self.device, self.whole)
        if current_raw_stream(record.device.index) != self.stream:
            # another stream: keep the allocator from reusing the memory before this copy ran
            record.record_stream(torch.cuda.current_stream(record.device))
        return {BLOCK: record} if self.whole else self.stage.views(record)


class QwenPacker:
    """Inputs to graph buffers for one tower.

    Args:
        layout: the merge and window geometry the metadata depends on.
        patch_dim: columns of ``pixel_values`` (``C * temporal_patch * patch**2``).
        item_extras: a family's extra per-item buffers (Qwen3-VL's position interpolation).
    """

    def __init__(self, layout: QwenLayout, patch_dim: int,
                 item_extras: Callable[[Grid], dict[str, torch.Tensor]]) -> None:
        self.layout, self.merge, self.patch_dim = layout, layout.merge, patch_dim
        self.metadata = MetadataCache(layout, item_extras)
        #: the segment buffer lengths each captured budget holds (checked at replay)
        self.captured_slots: dict[int, SegmentSlots] = {}
        #: the metadata buffers' shapes of each captured budget (replay pads to them on the host)
        self.captured_shapes: dict[int, dict[str, torch.Size]] = {}
        #: the layout of each captured budget's metadata block
        self.captured_layouts: dict[int, Layout] = {}
        #: staged replay inputs by (call's grids, batch's items, budget), least recent first
        self._staged: OrderedDict[tuple, _Staged] = OrderedDict()
        self._staged_lock = threading.Lock()
        #: bytes of GPU memory the staged batches' records hold
        self.staged_bytes = 0
        #: each grid's spec, by its ``(t, h, w)`` (:data:`KEPT_SPECS`)
        self._specs: dict[Grid, EncoderItemSpec] = {}

    def check(self, inputs: Mapping[str, object]) -> PackedInputs:
        """The one input check of specs, eager and replay (a :class:`PackedCall` keeps it)."""
        if isinstance(inputs, PackedCall) and inputs.checked is not None:
            grid, pixels, grids = inputs.checked
            if inputs.get("grid_thw") is grid and inputs.get("pixel_values") is pixels:
                return PackedInputs(grids, pixels)
        checked = check_packed_inputs(inputs, merge=self.merge, patch_dim=self.patch_dim,
                                      rows=getattr(inputs, "rows", None))
        if isinstance(inputs, PackedCall):
            inputs.checked = (inputs["grid_thw"], checked.pixel_values, checked.grids)
        return checked

    def item_specs(self, inputs: Mapping[str, torch.Tensor]) -> list[EncoderItemSpec]:
        """One spec per ``grid_thw`` row: ``(t*h*w, t*(h//m)*(w//m), t)``."""
        specs, m = self._specs, self.merge
        out = []
        for grid in self.check(inputs).grids:
            if type(grid) is not tuple:  # a row given as a list: a key must be hashable
                grid = tuple(grid)
            spec = specs.get(grid)
            if spec is None:  # frozen: one spec serves every call of the grid
                t, h, w = grid
                spec = EncoderItemSpec(t * h * w, t * (h // m) * (w // m), t)
                if len(specs) >= KEPT_SPECS:
                    specs.clear()
                specs[grid] = spec
            out.append(spec)
        return out

    def pack(self, grids: Sequence[Grid], indices: Sequence[int],
             slots: SegmentSlots | None = None) -> PackedMetadata:
        """Metadata of items ``indices`` of ``grids``, back to back (their pixel rows start
        where the earlier grids' rows end)."""
        starts = _row_starts(grids)
        return pack_metadata([self.metadata(grids[i]) for i in indices], self.layout,
                             [starts[i] for i in indices], slots)

    def capture_values(self, budget: int, max_batch_size: int,
                       max_frames_per_batch: int | None, device: torch.device,
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Static buffers of ``budget``'s graph: ``max_batch_size`` slots of
        ``ceil(budget / max_batch_size)`` tokens (one ``1 x m*tokens`` strip of patches per
        slot), and segment buffers for ``max_frames_per_batch`` frames (one per slot if
        ``None``)."""
        layout = capture_layout(budget, max_batch_size, max_frames_per_batch)
        m = self.merge
        grids = [(1, m, m * layout.tokens_per_slot)] * layout.slots
        slots = segment_slots(self.layout, layout.capacity, layout.slots * layout.frames_per_slot)
        meta = self.pack(grids, range(len(grids)), slots)
        if self.layout.window:  # rows start at 0: the index is local to the static rows
            meta.values[ROW_INDEX] = meta.row_index
        self.captured_slots[budget] = slots
        self.captured_shapes[budget] = {key: value.shape for key, value in meta.values.items()}
        self._drop_staged(budget)  # padded to the old shapes: never loaded again
        # the metadata buffers are views of one block: a replay of that layout fills it in one copy
        values = upload(meta.values, device, blocks=True)
        self.captured_layouts[budget] = layout_of(meta.values, self.captured_shapes[budget])[0]
        values["pixel_values"] = torch.zeros(meta.rows, self.patch_dim, device=device, dtype=dtype)
        return values

    def replay_values(self, inputs: Mapping[str, torch.Tensor], item_indices: Sequence[int],
                      budget: int) -> Mapping[str, torch.Tensor]:
        """The items' pixel rows, back to back and unpadded, and their metadata padded to the
        captured shapes, as ``protocol.StampedBuffers``. The metadata is staged once per batch
        (the last :data:`STAGED_BATCHES`, GPU copies within :data:`STAGED_DEVICE_BYTES`).
        Window-order towers gather their rows in the graph from :data:`ROW_INDEX`.

        Raises:
            UnsupportedGraphError: the items hold more tokens, frames or windows than
                ``budget``'s graph was captured for (the runtime then runs them eagerly).
        """
        shapes = self.captured_shapes.get(budget)
        checked = self.check(inputs)
        pixels = checked.pixel_values
        if shapes is None:  # no capture on record: unpadded (the runtime pads)
            meta, parts = self._local(checked.grids, item_indices, budget)
            values = dict(meta.values)
            if self.layout.window:  # a zero-padded tail gathers row 0: finite, never read
                values[ROW_INDEX] = meta.row_index
            return {**upload(values, pixels.device), "pixel_values": _pixels(parts, pixels)}
        key = (tuple(checked.grids), tuple(item_indices), budget)
        with self._staged_lock:
            staged = self._staged.get(key)
            if staged is not None:
                self._staged.move_to_end(key)
        if staged is None or staged.shapes is not shapes or staged.device != pixels.device:
            staged = self._stage(checked.grids, item_indices, budget, shapes, pixels.device)
            self._keep(key, staged)
        return StampedBuffers({"pixel_values": _pixels(staged.parts, pixels)}, staged,
                              staged.load)

    def _stage(self, grids: Sequence[Grid], item_indices: Sequence[int], budget: int,
               shapes: Mapping[str, torch.Size], device: torch.device) -> _Staged:
        meta, parts = self._local(grids, item_indices, budget)
        values = meta.values
        if self.layout.window:
            # the padding rows gather themselves (the zeroed tail)
            index = torch.arange(shapes[ROW_INDEX][0], dtype=meta.row_index.dtype)
            index[:meta.rows] = meta.row_index
            values = {**values, ROW_INDEX: index}
        stage = HostStage(values, shapes)
        whole = stage.layout == self.captured_layouts.get(budget)
        if device.type != "cuda" or stage.nbytes > STAGED_DEVICE_BYTES:
            return _Staged(stage, parts, shapes, whole, device)
        try:
            record = stage.on_device(device)
        except torch.OutOfMemoryError as exc:  # no room: each load copies a pinned block
            log.debug("vitgraph: no GPU memory for a staged batch's metadata (%s)",
                      str(exc).split("\n")[0])
            return _Staged(stage, parts, shapes, whole, device)
        return _Staged(stage, parts, shapes, whole, device, record,
                       current_raw_stream(record.device.index))

    def _keep(self, key: tuple, staged: _Staged) -> None:
        """Keep ``staged``, dropping the least recent batches beyond the limits."""
        with self._staged_lock:
            old = self._staged.pop(key, None)
            if old is not None:
                self.staged_bytes -= _record_bytes(old)
            self._staged[key] = staged
            self.staged_bytes += _record_bytes(staged)
            while len(self._staged) > 1 and (len(self._staged) > STAGED_BATCHES
                                             or self.staged_bytes > STAGED_DEVICE_BYTES):
                self.staged_bytes -= _record_bytes(self._staged.popitem(last=False)[1])

    def _drop_staged(self, budget: int) -> None:
        """Drop the batches staged for ``budget`` (captured again: new shapes)."""
        with self._staged_lock:
            for key in [key for key in self._staged if key[2] == budget]:
                self.staged_bytes -= _record_bytes(self._staged.pop(key))

    def _local(self, grids: Sequence[Grid], item_indices: Sequence[int], budget: int
               ) -> tuple[PackedMetadata, tuple[tuple[int, int], ...]]:
        """The batch's metadata (rows from 0), checked against ``budget``, and its source rows."""
        batch = [grids[i] for i in item_indices]
        meta = self.pack(batch, range(len(batch)))
        self._check_fits(meta, item_indices, budget)
        return meta, _parts(grids, item_indices)

    def _check_fits(self, meta: PackedMetadata, item_indices: Sequence[int], budget: int) -> None:
        if meta.tokens > budget:
            raise UnsupportedGraphError(
                f"items {list(item_indices)} have {meta.tokens} tokens, more than budget {budget}")
        slots = self.captured_slots.get(budget)
        if slots is not None:
            frames = meta.values["frame_seqlens"].numel()
            windows = meta.values["window_seqlens"].numel() if self.layout.window else 0
            if frames > slots.frames or windows > slots.windows:
                raise UnsupportedGraphError(
                    f"items {list(item_indices)} have {frames} frames and {windows} windows; "
                    f"budget {budget} was captured for {slots.frames} frames and "
                    f"{slots.windows} windows: set max_frames_per_batch so the planner caps the "
                    "frames of a batch (without it, capture assumes one frame per item)")

    def eager_values(self, inputs: Mapping[str, torch.Tensor], item_indices: Sequence[int]
                     ) -> tuple[dict[str, torch.Tensor], PackedMetadata]:
        """The items' buffers with exact lengths (the pixel rows in graph order: a view when
        contiguous), and the metadata the eager run needs."""
        checked = self.check(inputs)
        grids, pixels = checked.grids, checked.pixel_values
        meta = self.pack(grids, list(item_indices))
        if self.layout.window:  # window order: gathered by the row index
            index = upload({"index": meta.row_index}, pixels.device)["index"]
            pixels = pixels.index_select(0, index)
        else:  # the items' rows, back to back: no gather index needed
            pixels = _pixels(_parts(grids, item_indices), pixels)
        values = upload(meta.values, pixels.device)
        values["pixel_values"] = pixels
        return values, meta

    def rows(self, inputs: Mapping[str, torch.Tensor], item_indices: Sequence[int]
             ) -> tuple[torch.Tensor, list[Grid]]:
        """The items' pixel rows back to back in the caller's layout, and their grids."""
        checked = self.check(inputs)
        grids = checked.grids
        return (_pixels(_parts(grids, item_indices), checked.pixel_values),
                [grids[i] for i in item_indices])

    def segments(self, values: Mapping[str, torch.Tensor], meta: PackedMetadata | None
                 ) -> tuple[Segments, Segments | None]:
        """Offsets for full and window attention. The padding rows form one segment (full) or
        window-sized chunks (window: ``max_seqlen`` stays one window)."""
        rows = values["pixel_values"].shape[0]
        lengths = values["frame_seqlens"].cumsum(0, dtype=torch.int32)
        # a tensor op, not F.pad(value=rows), which would specialize a symbolic row count
        end = torch.full((1,), rows, dtype=lengths.dtype, device=lengths.device)
        full_offsets = torch.cat([F.pad(lengths, (1, 0)), end])
        full = (Segments(full_offsets, rows) if meta is None
                else Segments(full_offsets, max(meta.max_frame_rows, 1), meta.frame_offsets))
        if not self.layout.window:
            return full, None
        wins = F.pad(values["window_seqlens"].cumsum(0, dtype=torch.int32), (1, 0))
        if meta is not None:
            return full, Segments(wins, max(meta.max_window_rows, 1), meta.window_offsets)
        chunk = self.layout.window_rows
        # ceil(rows / chunk) + 1 chunk ends, surplus ones clamped to rows; the +1 keeps the count
        # >= 2 for every budget, or Dynamo's size-1 guard would cost a second trace
        steps = torch.arange(1, ceil_div(rows, chunk) + 2, device=wins.device, dtype=torch.int32)
        pad_offsets = torch.clamp(wins[-1] + chunk * steps, max=rows)
        # max_seqlen: one window's rows (a min() with rows would make Dynamo specialize)
        return full, Segments(torch.cat([wins, pad_offsets]), chunk)


def _record_bytes(staged: _Staged) -> int:
    return 0 if staged.record is None else staged.record.numel()


def _row_starts(grids: Sequence[Grid]) -> list[int]:
    """The first source pixel row of each item: the rows of the items before it."""
    starts, row = [], 0
    for t, h, w in grids:
        starts.append(row)
        row += t * h * w
    return starts


def _parts(grids: Sequence[Grid], item_indices: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The source pixel rows of ``item_indices`` as ``(start, count)`` ranges, adjacent merged."""
    starts, parts = _row_starts(grids), []
    for i in item_indices:
        start, count = starts[i], grids[i][0] * grids[i][1] * grids[i][2]
        if parts and parts[-1][0] + parts[-1][1] == start:
            parts[-1] = (parts[-1][0], parts[-1][1] + count)
        else:
            parts.append((start, count))
    return tuple(parts)


def _pixels(parts: Sequence[tuple[int, int]], source: torch.Tensor) -> torch.Tensor:
    """The rows ``parts`` of ``source``, back to back (a view for one range, ``source`` for all)."""
    if len(parts) == 1:
        start, count = parts[0]
        return source if start == 0 and count == source.shape[0] else source.narrow(0, *parts[0])
    return torch.cat([source.narrow(0, start, count) for start, count in parts])
