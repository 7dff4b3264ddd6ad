"""Host-side metadata of the Qwen-VL vision towers: one function for eager, capture and replay.

Everything the towers derive from ``grid_thw`` (rotary position ids, per-frame segment lengths,
Qwen2.5-VL's window order and reverse index, family extras such as Qwen3-VL's interpolated
position embedding) is computed here from Python ints. Eager, capture and replay all call
:func:`pack_metadata`, so they cannot drift apart (``docs/adapters.md``).

- Segments are stored as **lengths**, turned into offsets in the graph by one ``cumsum``
  (``packing.QwenPacker.segments``). A short replay buffer zero-padded by the runtime is then a
  run of zero-length segments, and no per-budget state is needed.
- Padding rows ``[real_rows, buffer_rows)`` form their own segments, computed in the graph from
  the static shape: real tokens never attend to padding, and attention writes every row.
- Rows are laid out in the order the blocks consume them (Qwen2.5-VL: window order); only the
  final un-permute (``reverse_index``) runs in the graph.

Per-item pieces are cached by ``(t, h, w)``: serving traffic repeats image sizes.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..budgets import ceil_div
from .inputs import Grid

__all__ = ["Grid", "ItemMetadata", "MetadataCache", "PackedMetadata", "QwenLayout",
           "SegmentSlots", "item_metadata", "pack_metadata", "segment_slots"]

#: Per-row extras of one item, in HF's natural row order (e.g. Qwen3-VL's interpolation taps).
ExtrasFn = Callable[[Grid], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class QwenLayout:
    """The geometry that the metadata depends on.

    Attributes:
        merge: ``spatial_merge_size``; ``merge**2`` consecutive rows become one output token.
        window: Qwen2.5-VL window side in merged tokens
            (``window_size // spatial_merge_size // patch_size``); ``0`` for no window attention.
    """

    merge: int
    window: int = 0

    @property
    def unit(self) -> int:
        """Rows per output token (``merge**2``)."""
        return self.merge * self.merge

    @property
    def window_rows(self) -> int:
        """Rows of a full window (the longest window segment)."""
        return self.window * self.window * self.unit


@dataclass(frozen=True)
class SegmentSlots:
    """Lengths of the segment buffers of one captured budget (static per budget)."""

    frames: int
    windows: int = 0


@dataclass(frozen=True)
class ItemMetadata:
    """One item's host tensors, rows in the order the blocks consume them (cached, read-only)."""

    rows: int
    tokens: int
    position_ids: torch.Tensor        # (rows, 2) int64: (h, w) rotary positions
    row_perm: torch.Tensor | None     # (rows,) int64: natural row of each row; None = identity
    token_reverse: torch.Tensor | None  # (tokens,) int64: graph position of natural token j
    frame_seqlens: list[int]
    window_seqlens: list[int]
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class PackedMetadata:
    """A batch's metadata: host buffers plus what the eager path needs on the host.

    Attributes:
        values: buffers keyed as in the capture inputs (CPU tensors, no ``pixel_values``).
        row_index: rows of the source pixel tensor, in graph order.
        rows: real input rows. ``tokens``: real output tokens.
        frame_offsets / window_offsets: cumulative offsets of the real segments (eager).
        max_frame_rows / max_window_rows: exact longest real segments.
    """

    values: dict[str, torch.Tensor]
    row_index: torch.Tensor
    rows: int
    tokens: int
    frame_offsets: list[int]
    window_offsets: list[int]
    max_frame_rows: int
    max_window_rows: int


def _block_major_positions(t: int, h: int, w: int, m: int) -> torch.Tensor:
    """(h, w) rotary positions per row in HF's ``m x m`` block-major order, per frame."""
    shape = (h // m, m, w // m, m)
    grids = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    hpos, wpos = (g.reshape(shape).transpose(1, 2).flatten() for g in grids)
    return torch.stack([hpos, wpos], dim=-1).repeat(t, 1)


def _window_order(t: int, gh: int, gw: int, ws: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's window order of one item's tokens and its windows' token counts, as
    ``transformers.vision_utils.get_vision_window_index`` (empty windows dropped)."""
    nwh, nww = ceil_div(gh, ws), ceil_div(gw, ws)
    index = torch.arange(t * gh * gw).reshape(t, gh, gw)
    padded = torch.full((t, nwh * ws, nww * ws), -1, dtype=torch.long)
    padded[:, :gh, :gw] = index
    padded = padded.reshape(t, nwh, ws, nww, ws).permute(0, 1, 3, 2, 4).reshape(t, nwh * nww, -1)
    counts = (padded >= 0).sum(-1).flatten()
    order = padded.flatten()
    return order[order >= 0], [int(c) for c in counts if c > 0]


def item_metadata(grid: Grid, layout: QwenLayout, extras: ExtrasFn | None = None) -> ItemMetadata:
    """Host tensors of one item (uncached; see :class:`MetadataCache`)."""
    t, h, w = grid
    m, unit = layout.merge, layout.unit
    rows, tokens = t * h * w, t * (h // m) * (w // m)
    positions = _block_major_positions(t, h, w, m)
    item_extras = dict(extras(grid)) if extras is not None else {}
    row_perm = token_reverse = None
    window_seqlens: list[int] = []
    if layout.window:
        order, counts = _window_order(t, h // m, w // m, layout.window)
        row_perm = (order.unsqueeze(1) * unit + torch.arange(unit)).flatten()
        token_reverse = torch.argsort(order)
        positions = positions[row_perm]
        item_extras = {k: v[row_perm] for k, v in item_extras.items()}
        window_seqlens = [c * unit for c in counts]
    return ItemMetadata(rows, tokens, positions, row_perm, token_reverse, [h * w] * t,
                        window_seqlens, item_extras)


class MetadataCache:
    """A small thread-safe LRU of :func:`item_metadata` results keyed by grid."""

    def __init__(self, layout: QwenLayout, extras: ExtrasFn | None = None, size: int = 512):
        self.layout, self.extras, self.size = layout, extras, size
        self._items: OrderedDict[Grid, ItemMetadata] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, grid: Grid) -> ItemMetadata:
        with self._lock:
            item = self._items.get(grid)
            if item is not None:
                self._items.move_to_end(grid)
                return item
        item = item_metadata(grid, self.layout, self.extras)
        with self._lock:
            self._items[grid] = item
            if len(self._items) > self.size:
                self._items.popitem(last=False)
        return item


def segment_slots(layout: QwenLayout, capacity: int, max_frames: int) -> SegmentSlots:
    """Segment buffer lengths that hold any batch of ``<= capacity`` tokens and ``<= max_frames``
    frames.

    Frames: ``min(capacity, max_frames)``. Windows: a batch has at most
    ``(tokens + frames*(ws-1)) // ws`` windows, never more than its tokens. Tight bounds matter:
    flash varlen launches thread blocks for every segment, empty ones included.
    """
    frames = min(capacity, max_frames)
    windows = 0
    if layout.window:
        ws = layout.window
        windows = min(capacity, (capacity + frames * (ws - 1)) // ws)
    return SegmentSlots(frames, windows)


def _padded(values: list[int], length: int | None, name: str) -> torch.Tensor:
    if length is not None:
        if len(values) > length:
            raise ValueError(f"{len(values)} {name} do not fit {length} slots")
        values = values + [0] * (length - len(values))
    return torch.tensor(values, dtype=torch.int32)


def pack_metadata(items: Sequence[ItemMetadata], layout: QwenLayout, row_starts: Sequence[int],
                  slots: SegmentSlots | None = None) -> PackedMetadata:
    """Pack items back to back into a :class:`PackedMetadata` of CPU tensors: the one metadata
    function of eager, capture and replay.

    Args:
        items: the batch's items, in batch order (from :class:`MetadataCache`).
        row_starts: first row of each item in the source pixel tensor.
        slots: pad the segment buffers to these lengths (capture); ``None`` keeps the real
            lengths (eager, replay).
    """
    row_parts, pos_parts, rev_parts, frames, windows = [], [], [], [], []
    extras: dict[str, list[torch.Tensor]] = {}
    tokens = 0
    for item, start in zip(items, row_starts, strict=True):
        perm = item.row_perm if item.row_perm is not None else torch.arange(item.rows)
        row_parts.append(perm + start)
        pos_parts.append(item.position_ids)
        if item.token_reverse is not None:
            rev_parts.append(item.token_reverse + tokens)
        for key, value in item.extras.items():
            extras.setdefault(key, []).append(value)
        frames += item.frame_seqlens
        windows += item.window_seqlens
        tokens += item.tokens
    rows = sum(item.rows for item in items)
    values = {
        "position_ids": torch.cat(pos_parts),
        "frame_seqlens": _padded(frames, slots.frames if slots else None, "frames"),
    }
    if layout.window:
        values["window_seqlens"] = _padded(windows, slots.windows if slots else None, "windows")
        values["reverse_index"] = torch.cat(rev_parts)
    values.update({key: torch.cat(parts) for key, parts in extras.items()})
    frame_offsets = list(itertools.accumulate(frames, initial=0))
    window_offsets = list(itertools.accumulate(windows, initial=0))
    return PackedMetadata(values, torch.cat(row_parts), rows, tokens, frame_offsets,
                          window_offsets, max(frames, default=0), max(windows, default=0))
