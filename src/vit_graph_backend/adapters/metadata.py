"""Host-side metadata of the Qwen-VL vision towers: one function for eager, capture and replay.

Everything the towers derive from ``grid_thw`` with Python loops or ``.tolist()`` is computed here,
on the host, from Python ints: rotary position ids, per-frame attention segment lengths, the
Qwen2.5-VL window order, window segment lengths and the reverse (unwindowing) index, and any
per-row extras a family adds (Qwen3-VL's interpolated learned position embedding). The eager
forward, the capture inputs and the replay buffers all call :func:`pack_metadata`, so the three
cannot drift apart (``docs/adapters.md`` lists the padding traps this avoids).

Buffer design (why lengths, not offsets):

- Attention segments are stored as **lengths** (``frame_seqlens``, ``window_seqlens``), not
  cumulative offsets. The captured function turns them into offsets with one ``cumsum`` and
  appends the padding segment itself (see ``QwenPacker.segments`` in ``_qwen_packing``). A replay buffer shorter than
  the capture buffer is then correct as the runtime pads it: the zeroed tail is a run of
  zero-length segments, which is exactly "repeat the last offset". Offsets frozen at capture
  cannot happen, and the adapter needs no per-budget state to size a replay buffer.
- The padding rows ``[real_rows, buffer_rows)`` always form their own segment(s), computed in
  the graph from the static shape, so real tokens never attend to padding and every padding row
  is written by attention (no unwritten rows that could carry stale NaNs from a shared pool).
- Rows are laid out in the order the blocks consume them. For Qwen2.5-VL that is the window
  order: ``row_index`` gathers the input patches already permuted (the patch embedding is
  per-row, so permuting its input equals HF's permuting of its output), position ids are
  emitted permuted, and only the final un-permute (``reverse_index``) runs in the graph.

Per-item pieces are cached by ``(t, h, w)``: serving traffic repeats image sizes, and a cached item
costs a few tensor concatenations per batch.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..budgets import ceil_div

__all__ = ["Grid", "ItemMetadata", "MetadataCache", "PackedMetadata", "QwenLayout",
           "SegmentSlots", "item_metadata", "pack_metadata", "segment_slots"]

#: ``(t, h, w)``: temporal patches, height and width in patches, as in ``grid_thw``.
Grid = tuple[int, int, int]

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
        row_index: rows of the *source* pixel tensor, in graph order (gather the pixels with it).
        rows: real input rows. ``tokens``: real output tokens.
        frame_offsets / window_offsets: host cumulative offsets of the real segments, for the
            per-segment eager attention (no padding segments).
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
    """(h, w) rotary positions of each row in HF's order: per frame, ``m x m`` blocks row-major,
    rows inside a block row-major; repeated for each frame (``get_vision_position_ids``)."""
    hpos = torch.arange(h).unsqueeze(1).expand(h, w)
    wpos = torch.arange(w).unsqueeze(0).expand(h, w)
    shape = (h // m, m, w // m, m)
    hpos = hpos.reshape(shape).transpose(1, 2).flatten()
    wpos = wpos.reshape(shape).transpose(1, 2).flatten()
    return torch.stack([hpos, wpos], dim=-1).repeat(t, 1)


def _window_order(t: int, gh: int, gw: int, ws: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's window order of one item's tokens and its windows' token counts.

    Per frame, the ``gh x gw`` token grid is cut into ``ws x ws`` windows, row-major, the last
    row/column of windows possibly partial; tokens inside a window are row-major. Matches
    ``transformers.vision_utils.get_vision_window_index`` (its padding-only windows have zero
    length and are dropped, as its ``unique_consecutive`` does).
    """
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

    Frames: ``min(capacity, max_frames)`` (each frame has at least one token). Windows: a frame of
    ``gh x gw`` tokens has ``ceil(gh/ws) * ceil(gw/ws) <= (gh*gw + ws - 1) / ws`` windows (use
    ``gh + gw <= gh*gw + 1``), so a batch has at most ``(tokens + frames*(ws-1)) // ws`` windows,
    and never more than its tokens. Tight bounds matter: flash varlen attention launches
    ``ceil(max_seqlen / 128) * segments * heads`` thread blocks, empty segments included.
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


def pack_metadata(
    items: Sequence[ItemMetadata],
    layout: QwenLayout,
    row_starts: Sequence[int],
    slots: SegmentSlots | None = None,
) -> PackedMetadata:
    """Pack items back to back: the one metadata function of eager, capture and replay.

    Args:
        items: the batch's items, in batch order (from :class:`MetadataCache`).
        layout: the tower's geometry.
        row_starts: first row of each item in the source pixel tensor (``row_index`` points
            there).
        slots: pad the segment buffers to these lengths (capture); ``None`` leaves them at the
            batch's real length (eager, replay: the runtime zero-fills a short buffer's tail,
            which adds zero-length segments).

    Returns:
        The batch's :class:`PackedMetadata`. Buffers are CPU tensors; the graph adds the padding
        segments from its static shapes.
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
