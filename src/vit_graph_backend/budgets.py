"""Token budgets: the ladder, the four configuration paths and ceil sizing of capture slots.

A *budget* is the number of output tokens one CUDA graph is captured for; each batch replays the
graph of the smallest budget that holds it (``planner``). Pure Python, so the invariants are
property-tested in milliseconds. The central invariant, held on every configuration path, is
``max_items_per_graph <= min(budgets)``: every item slot of a captured graph gets at least one
token (vLLM crashed on a zero-token slot). Inside :class:`BudgetConfig` that number keeps vLLM's
name, ``max_batch_size``, so code ported from vLLM reads the same.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .errors import InvalidOptionError
from .specs import check_positive_int

__all__ = ["DEFAULT_PACKED_MAX_BUDGET", "MIN_BUDGET_IMAGE_SIDE", "BudgetConfig", "CaptureLayout",
           "budget_ladder", "capture_layout", "ceil_div", "check_items_fit", "check_ladder_steps",
           "normalize_budgets", "packed_budget_range", "smallest_fitting"]


def ceil_div(total: int, parts: int) -> int:
    """``ceil(total / parts)`` in exact integer arithmetic (no float rounding for large values)."""
    return -(-total // parts)


#: Most budgets one doubling may be split into (``ladder_steps``); finer ladders add graphs
#: (capture time, static buffers) faster than they cut padding.
MAX_LADDER_STEPS = 16

def budget_ladder(start: int, stop: int, ladder_steps: int = 1) -> tuple[int, ...]:
    """Budgets growing from ``start`` and ending exactly at ``stop``.

    With ``ladder_steps=1`` the ladder doubles, its last step possibly shorter:
    ``budget_ladder(64, 1000) == (64, 128, 256, 512, 1000)``. With ``k`` steps each doubling
    ``b .. 2b`` is split at ``b * (1 + m / k)`` (rounded up), so every step from ``a`` is at most
    ``ceil(a / k)``: ``budget_ladder(1, 32, 2) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)``.

    Raises:
        InvalidOptionError: if either end is not a positive integer, ``start > stop``, or
            ``ladder_steps`` is not an integer in ``1..MAX_LADDER_STEPS``."""
    check_positive_int("ladder start", start)
    check_positive_int("ladder stop", stop)
    check_ladder_steps("ladder_steps", ladder_steps)
    if start > stop:
        raise InvalidOptionError(
            f"ladder start={start} is larger than ladder stop={stop}: a budget ladder must "
            "start at or below its largest budget")
    k = ladder_steps
    ladder = {start}
    base = start
    while base < stop:
        ladder.update(v for v in (ceil_div(base * (k + m), k) for m in range(k)) if v < stop)
        base *= 2
    ladder.add(stop)
    return tuple(sorted(ladder))


#: The packed towers' default largest budget in output tokens at a 2 x 2 merge (1792 x 1792 px at
#: patch 14); a tower that merges fewer patches a token gets as many patches (merge 1: 16384).
DEFAULT_PACKED_MAX_BUDGET = 4096
#: The packed towers' smallest default budget is the token count of a square image of this side.
MIN_BUDGET_IMAGE_SIDE = 224


def packed_budget_range(patch: int, merge: int) -> tuple[int, int]:
    """A packed tower's default ``(min_budget, max_budget)`` in output tokens: a square image of
    :data:`MIN_BUDGET_IMAGE_SIDE` pixels, and the tokens of :data:`DEFAULT_PACKED_MAX_BUDGET`
    2 x 2-merged tokens' patches (or the smallest, if larger).

    >>> packed_budget_range(14, 2), packed_budget_range(4, 2), packed_budget_range(16, 1)
    ((64, 4096), (784, 4096), (196, 16384))
    """
    side = max(1, MIN_BUDGET_IMAGE_SIDE // (check_positive_int("patch", patch)
                                            * check_positive_int("merge", merge)))
    largest = DEFAULT_PACKED_MAX_BUDGET * 4 // merge ** 2
    return side * side, max(largest, side * side, 1)


def check_ladder_steps(name: str, value: object) -> int:
    """``value`` if it is an integer in ``1..MAX_LADDER_STEPS``, else a clear error."""
    check_positive_int(name, value)
    if value > MAX_LADDER_STEPS:  # type: ignore[operator]
        raise InvalidOptionError(
            f"{name}={value} is invalid: must be an integer in 1..{MAX_LADDER_STEPS} "
            "(1 doubles the budget at every step; k splits each doubling into k steps)")
    return value  # type: ignore[return-value]


def smallest_fitting(budgets: tuple[int, ...], tokens: int) -> int | None:
    """The smallest budget ``>= tokens`` from sorted ``budgets``, or ``None`` if none holds them."""
    return next((budget for budget in budgets if budget >= tokens), None)


def normalize_budgets(budgets: Iterable[int], name: str = "budgets") -> tuple[int, ...]:
    """User budgets as the sorted, de-duplicated tuple every resolved config holds; raises
    :class:`InvalidOptionError` unless ``budgets`` is a non-empty sequence of positive integers."""
    if isinstance(budgets, (str, bytes)) or not isinstance(budgets, Iterable):
        raise InvalidOptionError(
            f"{name}={budgets!r} is invalid: must be a sequence of positive integers")
    values = list(budgets)
    if not values:
        raise InvalidOptionError(f"{name}=[] is invalid: give at least one positive integer")
    for i, value in enumerate(values):
        check_positive_int(f"{name}[{i}]", value)
    return tuple(sorted(set(values)))


def check_items_fit(items: int, smallest_budget: int, name: str = "max_items_per_graph") -> None:
    """The central invariant: ``items <= min(budgets)``, so each item slot of a graph gets a token;
    ``name``: the setting as the caller knows it (``max_items_per_graph`` or ``max_batch_size``)."""
    if items > smallest_budget:
        raise InvalidOptionError(
            f"{name}={items} is larger than the smallest budget min(budgets)={smallest_budget}: "
            f"every item slot of a graph needs at least one token; lower {name} or raise the "
            "smallest budget")


@dataclass(frozen=True)
class BudgetConfig:
    """A resolved, valid set of budgets and per-graph caps; build it with :meth:`resolve` (the
    constructor checks the invariants too).

    Args:
        budgets: sorted, unique, positive token budgets.
        max_batch_size: items one graph holds at most; ``<= min(budgets)``.
        max_frames_per_batch: frames one graph holds at most, or ``None`` for no frame cap."""

    budgets: tuple[int, ...]
    max_batch_size: int
    max_frames_per_batch: int | None = None

    def __post_init__(self) -> None:
        if normalize_budgets(self.budgets) != tuple(self.budgets):
            raise InvalidOptionError(
                f"budgets={self.budgets!r} is invalid: must be sorted, unique and positive; "
                "use BudgetConfig.resolve() to normalize user budgets")
        # a tuple even when given a list: the frozen config keys caches
        object.__setattr__(self, "budgets", tuple(self.budgets))
        check_positive_int("max_batch_size", self.max_batch_size)
        if self.max_frames_per_batch is not None:
            check_positive_int("max_frames_per_batch", self.max_frames_per_batch)
        check_items_fit(self.max_batch_size, self.budgets[0], "max_batch_size")

    @property
    def max_budget(self) -> int:
        """The largest budget; items with more output tokens never fit a graph."""
        return self.budgets[-1]

    @classmethod
    def resolve(cls, budget_range: tuple[int, int], *, budgets: Iterable[int] | None = None,
                max_batch_size: int | None = None, max_frames_per_batch: int | None = None,
                ladder_steps: int = 1, items_name: str = "max_batch_size") -> BudgetConfig:
        """Resolve user choices against the model's ``(min_budget, max_budget)`` range.

        The four paths (every one keeps ``max_batch_size <= min(budgets)``, so each item slot of
        a captured graph gets at least one token):

        1. budgets and ``max_batch_size`` given: both kept; ``max_batch_size > min(budgets)``
           raises, naming both numbers.
        2. only ``max_batch_size``: ladder from ``max(min_budget, max_batch_size)`` to
           ``max_budget``.
        3. only budgets: ``max_batch_size = min(max_budget // min_budget, min(budgets))``.
        4. neither: ladder from ``min_budget`` to ``max_budget``; ``max_batch_size`` as in 3.

        User budgets are de-duplicated and sorted; the model's range only seeds defaults.

        Args:
            budget_range: the model's ``(min_budget, max_budget)``; positive, ``min <= max``.
            max_frames_per_batch: frames per graph, or ``None`` for no frame cap.
            ladder_steps: how finely the ladder splits each doubling (paths 2 and 4).
            items_name: how errors name ``max_batch_size`` (``"max_items_per_graph"`` when
                resolving user options).

        Raises:
            InvalidOptionError: (a ``ValueError``) naming the bad value and the allowed range.

        Example::

            >>> BudgetConfig.resolve((64, 1000))
            BudgetConfig(budgets=(64, 128, 256, 512, 1000), max_batch_size=15, max_frames_per_batch=None)
        """
        try:
            min_budget, max_budget = budget_range
        except (TypeError, ValueError):
            raise InvalidOptionError(
                f"budget_range={budget_range!r} is invalid: must be a pair (min_budget, max_budget)"
            ) from None
        check_positive_int("min_budget", min_budget)
        check_positive_int("max_budget", max_budget)
        if min_budget > max_budget:
            raise InvalidOptionError(
                f"min_budget={min_budget} is larger than max_budget={max_budget}")
        if max_batch_size is not None:
            check_positive_int(items_name, max_batch_size)
        if max_frames_per_batch is not None:
            check_positive_int("max_frames_per_batch", max_frames_per_batch)

        if budgets is not None:
            resolved = normalize_budgets(budgets)
            if max_batch_size is None:  # path 3
                max_batch_size = min(max_budget // min_budget, resolved[0])
            else:  # path 1
                check_items_fit(max_batch_size, resolved[0], items_name)
        elif max_batch_size is not None:  # path 2
            if max_batch_size > max_budget:
                raise InvalidOptionError(
                    f"{items_name}={max_batch_size} is larger than max_budget={max_budget}: no "
                    f"budget can give every item slot a token; lower {items_name}")
            resolved = budget_ladder(max(min_budget, max_batch_size), max_budget, ladder_steps)
        else:  # path 4
            resolved = budget_ladder(min_budget, max_budget, ladder_steps)
            max_batch_size = min(max_budget // min_budget, resolved[0])
        return cls(resolved, max_batch_size, max_frames_per_batch)


@dataclass(frozen=True)
class CaptureLayout:
    """How a budget's dummy capture input is split over its item slots: ``slots *
    tokens_per_slot >= budget`` and ``slots * frames_per_slot >= max_frames_per_batch``."""

    budget: int
    slots: int
    tokens_per_slot: int
    frames_per_slot: int

    @property
    def capacity(self) -> int:
        """Tokens the capture buffers hold (``slots * tokens_per_slot``, ``>= budget``)."""
        return self.slots * self.tokens_per_slot


def capture_layout(budget: int, max_batch_size: int,
                   max_frames_per_batch: int | None = None) -> CaptureLayout:
    """Size the dummy capture inputs of one budget (``max_batch_size <= budget`` item slots;
    ``max_frames_per_batch`` ``None``: one frame a slot) with ceil division. Not floor: a graph
    of budget ``B`` may serve one item that fills all of ``B``, and floor division leaves the
    slots fewer than ``B`` tokens whenever ``slots`` does not divide ``B`` (800 over 64 slots:
    768), overflowing the replay copy.

    Example::

        >>> capture_layout(800, 64)
        CaptureLayout(budget=800, slots=64, tokens_per_slot=13, frames_per_slot=1)
    """
    check_positive_int("budget", budget)
    check_positive_int("max_batch_size", max_batch_size)
    if max_batch_size > budget:
        raise InvalidOptionError(
            f"max_batch_size={max_batch_size} is larger than budget={budget}: a slot would get "
            "no token")
    frames = 1
    if max_frames_per_batch is not None:
        frames = ceil_div(check_positive_int("max_frames_per_batch", max_frames_per_batch),
                          max_batch_size)
    return CaptureLayout(budget, max_batch_size, ceil_div(budget, max_batch_size), frames)
