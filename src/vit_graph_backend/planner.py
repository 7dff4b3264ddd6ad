"""The bucketing pass: item specs in, an ordered plan of budgeted batches out.

Pure Python, no torch. The runtime executes a :class:`Plan` batch by batch: a batch with a budget
is padded to that budget and replayed from its CUDA graph; a batch without one runs eagerly.

Policies:
    - ``"baseline"`` (what vLLM's encoder graph manager does): sort items by output tokens,
      smallest first; fill a batch while its token sum fits the *largest* budget, its item count
      fits ``max_batch_size`` and its frames fit ``max_frames_per_batch``; then give it the
      *smallest* budget that holds it. An item that alone exceeds the largest budget (or the
      frame cap) runs eagerly on its own.
    - ``"exact"``: no padding ever. An item (or chunk) whose tokens equal a budget replays alone;
      the others are packed as in baseline, but such a batch replays only when its token sum
      equals a budget, and runs eagerly otherwise. With ``chunk`` a splittable item is first cut
      into budget-sized pieces, largest budget first (12 rows over ``(1, 2, 4, 8, 16)``: 8 + 4).

``chunk=True`` is for batched layouts, where an item is a run of independent rows: an item larger
than the largest budget is cut into largest-budget chunks plus a remainder instead of running
eagerly. The plan also gives the permutation that restores the caller's item order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from .budgets import BudgetConfig, smallest_fitting
from .errors import InvalidOptionError
from .specs import EncoderItemSpec

__all__ = ["POLICIES", "Batch", "Plan", "Policy", "Segment", "eager_reason", "plan_batches"]

Policy = Literal["baseline", "exact"]
POLICIES: tuple[str, ...] = ("baseline", "exact")

T = TypeVar("T")


@dataclass(frozen=True)
class Segment:
    """Output tokens ``[start, stop)`` of item ``item`` (a whole item unless it was chunked)."""

    item: int
    start: int
    stop: int

    @property
    def tokens(self) -> int:
        """Output tokens in this segment."""
        return self.stop - self.start


@dataclass(frozen=True)
class Batch:
    """Segments that run together, in the order they occupy the batch: replayed from
    ``budget``'s graph, or eagerly if it is ``None``; ``frames`` sums its items' frames."""

    segments: tuple[Segment, ...]
    budget: int | None
    frames: int

    @property
    def items(self) -> tuple[int, ...]:
        """Item indices in batch order (an item cut into chunks appears in several batches)."""
        return tuple(s.item for s in self.segments)

    @property
    def tokens(self) -> int:
        """Real output tokens in the batch."""
        return sum(s.tokens for s in self.segments)

    @property
    def padded_tokens(self) -> int:
        """Budget tokens left empty (0 for an eager batch)."""
        return 0 if self.budget is None else self.budget - self.tokens

    @property
    def eager(self) -> bool:
        """True if this batch runs without a graph."""
        return self.budget is None


@dataclass(frozen=True)
class Plan:
    """An ordered plan for one call: ``batches`` in execution order, ``num_items`` items, and
    ``restore_order[i]``: the position, in execution order, of caller item ``i``'s output (an item
    is emitted when the last of its segments has run)."""

    batches: tuple[Batch, ...]
    num_items: int
    restore_order: tuple[int, ...]

    @property
    def graph_batches(self) -> tuple[Batch, ...]:
        """Batches replayed from a graph."""
        return tuple(b for b in self.batches if not b.eager)

    @property
    def eager_items(self) -> tuple[int, ...]:
        """Items (caller indices, sorted) with at least one segment run eagerly."""
        return tuple(sorted({s.item for b in self.batches if b.eager for s in b.segments}))

    @property
    def real_tokens(self) -> int:
        """Real output tokens in graph batches."""
        return sum(b.tokens for b in self.graph_batches)

    @property
    def padded_tokens(self) -> int:
        """Padding tokens over all graph batches."""
        return sum(b.padded_tokens for b in self.batches)

    @property
    def padding_ratio(self) -> float:
        """Padding as a share of all tokens the graphs process (0.0 when nothing replays)."""
        total = self.real_tokens + self.padded_tokens
        return self.padded_tokens / total if total else 0.0

    @property
    def execution_order(self) -> tuple[int, ...]:
        """Caller item indices in the order their outputs are completed."""
        order = [0] * self.num_items
        for item, position in enumerate(self.restore_order):
            order[position] = item
        return tuple(order)

    def restore(self, outputs_in_execution_order: Sequence[T]) -> list[T]:
        """Put per-item outputs, given in execution order, back in the caller's order."""
        if len(outputs_in_execution_order) != self.num_items:
            raise ValueError(f"got {len(outputs_in_execution_order)} outputs for a plan of "
                             f"{self.num_items} items")
        return [outputs_in_execution_order[p] for p in self.restore_order]


def _split_for_chunking(
    item: int, spec: EncoderItemSpec, config: BudgetConfig, exact: bool
) -> list[Segment]:
    """Cut a row-item into largest-budget chunks and a remainder (with ``exact``, the remainder
    into the largest budgets that fit)."""
    if spec.input_size != spec.output_tokens or spec.frames != 1:
        raise InvalidOptionError(
            f"chunk=True needs row items (input_size == output_tokens, frames == 1); item {item} "
            f"has {spec}: packed items cannot be split, use chunk=False")
    pieces, start, remaining = [], 0, spec.output_tokens
    for budget in reversed(config.budgets):
        if not exact and budget != config.max_budget:
            break
        while remaining >= budget:
            pieces.append(Segment(item, start, start + budget))
            start += budget
            remaining -= budget
    if remaining:
        pieces.append(Segment(item, start, start + remaining))
    return pieces


def eager_reason(batch: Batch, config: BudgetConfig) -> str:
    """Why :func:`plan_batches` gave ``batch`` no budget under ``config`` (a fallback reason)."""
    if batch.tokens > config.max_budget:
        return "item exceeds the largest budget"
    if config.max_frames_per_batch is not None and batch.frames > config.max_frames_per_batch:
        return "item exceeds the frame cap per graph"
    return "exact policy: no budget equals the batch's tokens"


def plan_batches(specs: Sequence[EncoderItemSpec], config: BudgetConfig, *,
                 policy: Policy = "baseline", chunk: bool = False) -> Plan:
    """Plan one call's items (one spec per item, in the caller's order) into budgeted batches
    under ``policy`` (module docstring); ``chunk``: cut row items larger than the largest budget
    into chunks instead of running them eagerly (batched layouts only).

    Returns:
        A :class:`Plan`: every item appears in exactly one batch (or, when chunked, in consecutive
        batches that cover its tokens once); batches are within their budget and caps.

    Raises:
        InvalidOptionError: for an unknown policy, or ``chunk`` with non-row items.

    Example::

        >>> cfg = BudgetConfig.resolve((64, 256), max_batch_size=4)
        >>> p = plan_batches([EncoderItemSpec(256, 64), EncoderItemSpec(1024, 256),
        ...                   EncoderItemSpec(4096, 1024)], cfg)
        >>> [(b.items, b.budget) for b in p.batches]
        [((0,), 64), ((1,), 256), ((2,), None)]
    """
    if policy not in POLICIES:
        raise InvalidOptionError(f"policy={policy!r} is invalid: must be one of {POLICIES}")
    exact = policy == "exact"
    max_budget, max_items = config.max_budget, config.max_batch_size
    max_frames = config.max_frames_per_batch
    budget_set = set(config.budgets)

    # whole items or chunks, smallest first (stable: ties keep caller order)
    units: list[tuple[Segment, int]] = []
    for i, spec in enumerate(specs):
        if chunk and (spec.output_tokens > max_budget or exact):
            units.extend((seg, 1) for seg in _split_for_chunking(i, spec, config, exact))
        else:
            units.append((Segment(i, 0, spec.output_tokens), spec.frames))
    units.sort(key=lambda unit: unit[0].tokens)

    batches: list[Batch] = []
    oversize: list[Batch] = []  # run last, after every graph batch
    current: list[Segment] = []
    tokens = frames = 0

    def close() -> None:
        nonlocal current, tokens, frames
        if current:
            budget = smallest_fitting(config.budgets, tokens)
            if exact and budget != tokens:
                budget = None
            batches.append(Batch(tuple(current), budget, frames))
        current, tokens, frames = [], 0, 0

    for seg, seg_frames in units:
        if seg.tokens > max_budget or (max_frames is not None and seg_frames > max_frames):
            oversize.append(Batch((seg,), None, seg_frames))  # fits no graph alone
            continue
        if exact and seg.tokens in budget_set:
            batches.append(Batch((seg,), seg.tokens, seg_frames))  # fills a graph exactly
            continue
        if (tokens + seg.tokens > max_budget or len(current) >= max_items
                or (max_frames is not None and frames + seg_frames > max_frames)):
            close()  # the segment does not fit the current batch
        current.append(seg)
        tokens += seg.tokens
        frames += seg_frames
    close()
    batches.extend(oversize)

    # an item is complete when its last segment has run
    last = {seg.item: (b, s) for b, batch in enumerate(batches)
            for s, seg in enumerate(batch.segments)}
    restore_order = [0] * len(specs)
    for position, item in enumerate(sorted(last, key=last.__getitem__)):
        restore_order[item] = position
    return Plan(tuple(batches), len(specs), tuple(restore_order))
