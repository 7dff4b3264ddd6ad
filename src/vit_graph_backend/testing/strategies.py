"""Hypothesis strategies for the package's value types, for this package's tests and for yours.

Each strategy checks its arguments when it is *called*, not at the first draw (like Hypothesis's
own ``order_check``): a bad argument fails at the line that wrote it, with an
:class:`~vit_graph_backend.errors.InvalidOptionError` (a ``ValueError``) naming it and its value.
Every strategy draws only valid values (configs through
:meth:`~vit_graph_backend.budgets.BudgetConfig.resolve`, ladders from
:func:`~vit_graph_backend.budgets.budget_ladder`), so property tests need no filter. This is the
only module of the package that imports ``hypothesis`` (the ``test`` extra).

Example::

    @given(budget_configs(max_value=512), item_spec_lists(max_tokens=1024))
    def test_every_graph_batch_fits(config, specs):
        for batch in plan_batches(specs, config).graph_batches:
            assert batch.tokens <= batch.budget
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from ..budgets import BudgetConfig, budget_ladder, ceil_div, check_ladder_steps
from ..errors import InvalidOptionError
from ..options import CAPTURE_MODES, INNER_COMPILERS, VitGraphOptions
from ..planner import POLICIES
from ..specs import EncoderItemSpec, check_positive_int

__all__ = ["budget_configs", "budget_ladders", "budget_ranges", "image_grids", "item_spec_lists",
           "item_specs", "token_counts", "vitgraph_options"]

#: Default upper bound for token counts and budgets (a 896x896 image at patch 14).
DEFAULT_MAX_TOKENS = 4096


def _check_range(name: str, low: Any, high: Any,
                 check: Callable[[str, Any], Any] = check_positive_int) -> None:
    """``check`` ``min_<name>`` and ``max_<name>``, then raise if ``low > high`` (in the message
    shape of Hypothesis's ``order_check``)."""
    check(f"min_{name}", low)
    check(f"max_{name}", high)
    if low > high:
        raise InvalidOptionError(f"min_{name}={low!r} is larger than max_{name}={high!r}")


def _check_non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidOptionError(f"{name}={value!r} is invalid: must be a non-negative integer, "
                                 f"got {type(value).__name__}")
    if value < 0:
        raise InvalidOptionError(f"{name}={value!r} is invalid: must be a non-negative integer")
    return value


def _check_optional_positive_int(name: str, value: object) -> int | None:
    return None if value is None else check_positive_int(name, value)


def token_counts(min_value: int = 1, max_value: int = DEFAULT_MAX_TOKENS) -> st.SearchStrategy[int]:
    """Positive token counts (output tokens of an item, or of a batch).

    Args:
        min_value: the smallest count drawn; a positive integer.
        max_value: the largest count drawn; ``>= min_value``.
    """
    _check_range("value", min_value, max_value)
    return st.integers(min_value, max_value)


def item_specs(min_tokens: int = 1, max_tokens: int = DEFAULT_MAX_TOKENS, max_frames: int = 1,
               merge: int | None = None) -> st.SearchStrategy[EncoderItemSpec]:
    """Valid :class:`~vit_graph_backend.specs.EncoderItemSpec` values.

    Args:
        min_tokens: the fewest output tokens an item has; a positive integer.
        max_tokens: the most output tokens an item has; ``>= min_tokens``.
        max_frames: the most frames an item has (drawn from ``1..max_frames``); 1 for images.
        merge: spatial merge factor ``m``: ``input_size == output_tokens * m * m`` (``1`` with
            ``max_frames=1``: row items); ``None`` draws ``input_size`` from
            ``1..4 * output_tokens``.
    """
    _check_range("tokens", min_tokens, max_tokens)
    check_positive_int("max_frames", max_frames)
    _check_optional_positive_int("merge", merge)
    return _item_specs(min_tokens, max_tokens, max_frames, merge)


# draw functions at module level: st.composite's inspection costs more than a draw
@st.composite
def _item_specs(draw: Any, min_tokens: int, max_tokens: int, max_frames: int,
                merge: int | None) -> EncoderItemSpec:
    tokens = draw(st.integers(min_tokens, max_tokens))
    frames = draw(st.integers(1, max_frames))
    if merge is None:
        input_size = draw(st.integers(1, 4 * tokens))
    else:
        input_size = tokens * merge * merge
    return EncoderItemSpec(input_size=input_size, output_tokens=tokens, frames=frames)


def item_spec_lists(min_size: int = 0, max_size: int = 16, *, min_tokens: int = 1,
                    max_tokens: int = DEFAULT_MAX_TOKENS, max_frames: int = 1,
                    merge: int | None = None) -> st.SearchStrategy[list[EncoderItemSpec]]:
    """Lists of item specs: the items of one call, in the caller's order.

    Args:
        min_size: the fewest items in a list; a non-negative integer.
        max_size: the most items in a list; ``>= min_size``.
        min_tokens: as in :func:`item_specs`.
        max_tokens: as in :func:`item_specs`.
        max_frames: as in :func:`item_specs`.
        merge: as in :func:`item_specs`.
    """
    _check_range("size", min_size, max_size, _check_non_negative_int)
    elements = item_specs(min_tokens, max_tokens, max_frames, merge)
    return st.lists(elements, min_size=min_size, max_size=max_size)


def budget_ranges(min_value: int = 1, max_value: int = DEFAULT_MAX_TOKENS
                  ) -> st.SearchStrategy[tuple[int, int]]:
    """A model's ``(min_budget, max_budget)`` budget range, ``min_budget <= max_budget``.

    Args:
        min_value: the smallest ``min_budget`` drawn; a positive integer.
        max_value: the largest ``max_budget`` drawn; ``>= min_value``.
    """
    _check_range("value", min_value, max_value)
    return _budget_ranges(min_value, max_value)


@st.composite
def _budget_ranges(draw: Any, min_value: int, max_value: int) -> tuple[int, int]:
    low = draw(st.integers(min_value, max_value))
    return low, draw(st.integers(low, max_value))


def budget_ladders(min_value: int = 1, max_value: int = DEFAULT_MAX_TOKENS, max_steps: int = 1
                   ) -> st.SearchStrategy[tuple[int, ...]]:
    """Budget ladders as :func:`~vit_graph_backend.budgets.budget_ladder` builds them.

    Each runs from ``start`` to exactly ``stop`` within ``[min_value, max_value]``, splitting
    each doubling into a drawn ``1..max_steps`` steps.

    Args:
        min_value: the smallest start drawn; a positive integer.
        max_value: the largest stop drawn; ``>= min_value``.
        max_steps: the most ``ladder_steps`` drawn, ``1..16``.
    """
    check_ladder_steps("max_steps", max_steps)
    return st.tuples(budget_ranges(min_value, max_value), st.integers(1, max_steps)).map(
        lambda r: budget_ladder(*r[0], r[1]))


def _budget_config_draws(min_value: int, max_value: int, max_budgets: int, max_frames: int | None
                         ) -> st.SearchStrategy[tuple[int, dict[str, Any], BudgetConfig]]:
    """``(path, resolve keyword arguments, config)``: tests check every path is drawn."""
    _check_range("value", min_value, max_value)
    check_positive_int("max_budgets", max_budgets)
    _check_optional_positive_int("max_frames", max_frames)
    frame_caps = st.none() if max_frames is None else st.none() | st.integers(1, max_frames)
    user_budgets = st.lists(st.integers(min_value, max_value), min_size=1, max_size=max_budgets)
    return _budget_configs(_budget_ranges(min_value, max_value), user_budgets, frame_caps)


@st.composite
def _budget_configs(draw: Any, ranges: st.SearchStrategy[tuple[int, int]],
                    user_budgets: st.SearchStrategy[list[int]],
                    frame_caps: st.SearchStrategy[int | None]
                    ) -> tuple[int, dict[str, Any], BudgetConfig]:
    budget_range = draw(ranges)
    path = draw(st.sampled_from((1, 2, 3, 4)))
    kwargs: dict[str, Any] = {"max_frames_per_batch": draw(frame_caps)}
    if path in (1, 3):
        kwargs["budgets"] = draw(user_budgets)
    if path == 1:  # keep the invariant max_batch_size <= min(budgets)
        kwargs["max_batch_size"] = draw(st.integers(1, min(kwargs["budgets"])))
    elif path == 2:  # a ladder from max(min_budget, max_batch_size) needs it <= max_budget
        kwargs["max_batch_size"] = draw(st.integers(1, budget_range[1]))
    return path, kwargs, BudgetConfig.resolve(budget_range, **kwargs)


def budget_configs(min_value: int = 1, max_value: int = DEFAULT_MAX_TOKENS, max_budgets: int = 6,
                   max_frames: int | None = None) -> st.SearchStrategy[BudgetConfig]:
    """Valid :class:`~vit_graph_backend.budgets.BudgetConfig` values.

    Built by :meth:`BudgetConfig.resolve` from a drawn range through its four paths, evenly
    (budgets and/or ``max_batch_size`` given or not), with ``max_batch_size <= min(budgets)``.

    Args:
        min_value: the smallest budget (and range bound) drawn; a positive integer.
        max_value: the largest budget (and range bound) drawn; ``>= min_value``.
        max_budgets: the most user budgets on the paths that take them; a positive integer.
        max_frames: the largest ``max_frames_per_batch`` drawn (``None`` is drawn too); ``None``
            draws configs without a frame cap only.
    """
    return _budget_config_draws(min_value, max_value, max_budgets, max_frames).map(
        lambda drawn: drawn[2])


def image_grids(patch: int = 14, merge: int = 2, min_side: int | None = None,
                max_side: int = 896, max_frames: int = 1
                ) -> st.SearchStrategy[tuple[int, int, int]]:
    """``(t, h, w)`` patch grids, as packed encoders (Qwen-VL's ``grid_thw``) describe an item.

    ``h`` and ``w`` count patches, are multiples of ``merge``, and ``h * patch`` and
    ``w * patch`` lie in ``[min_side, max_side]`` pixels.

    Args:
        patch: patch side in pixels; a positive integer.
        merge: spatial merge factor; ``h`` and ``w`` are multiples of it; a positive integer.
        min_side: the smallest image side in pixels; ``None`` for one merged patch
            (``patch * merge``).
        max_side: the largest image side in pixels; must leave room for at least one side that
            is a multiple of ``patch * merge`` at or above ``min_side``.
        max_frames: the most frames ``t`` (drawn from ``1..max_frames``); 1 for images.
    """
    check_positive_int("patch", patch)
    check_positive_int("merge", merge)
    check_positive_int("max_side", max_side)
    check_positive_int("max_frames", max_frames)
    step = patch * merge
    if min_side is None:
        if step > max_side:
            raise InvalidOptionError(
                f"max_side={max_side} is smaller than one merged patch, patch * merge = "
                f"{patch} * {merge} = {step} pixels; raise max_side or lower patch or merge")
        min_side = step
    _check_range("side", min_side, max_side)
    low, high = ceil_div(min_side, step), max_side // step
    if low > high:
        raise InvalidOptionError(
            f"min_side={min_side} and max_side={max_side} hold no multiple of "
            f"patch * merge = {patch} * {merge} = {step} pixels; widen the range or lower "
            "patch or merge")
    sides = st.integers(low, high).map(lambda k: k * merge)
    return st.tuples(st.integers(1, max_frames), sides, sides)


@st.composite
def _options(draw: Any, max_value: int) -> VitGraphOptions:
    budgets = draw(st.none() | st.lists(st.integers(1, max_value), min_size=1, max_size=6))
    lo = draw(st.none() | st.integers(1, max_value))
    hi = draw(st.none() | st.integers(lo or 1, max_value))
    items_cap = min(budgets) if budgets else max_value
    compilers = [c for c in INNER_COMPILERS if c != "tensorrt"]  # needs torch-tensorrt
    return VitGraphOptions(
        budgets=budgets, min_budget=lo, max_budget=hi,
        ladder_steps=draw(st.none() | st.integers(1, 16)),
        max_items_per_graph=draw(st.none() | st.integers(1, items_cap)),
        max_frames_per_batch=draw(st.none() | st.integers(1, 64)),
        policy=draw(st.sampled_from(POLICIES)),
        inner_compiler=draw(st.sampled_from(compilers)),
        # "background" answers on another thread's timing: not for reproducible properties
        capture=draw(st.sampled_from([m for m in CAPTURE_MODES if m != "background"])),
        warmup_iters=draw(st.integers(0, 3)),
        max_graph_sets=draw(st.integers(1, 8)),
        static_graphs=draw(st.booleans()),
        verify=draw(st.booleans()),
        verify_tolerance=draw(st.none() | st.floats(1e-6, 1.0)),
    )


def vitgraph_options(max_value: int = DEFAULT_MAX_TOKENS) -> st.SearchStrategy[VitGraphOptions]:
    """Valid :class:`~vit_graph_backend.options.VitGraphOptions`: every field drawn, budgets and
    bounds in ``1..max_value``; ``inner_compiler`` is never ``"tensorrt"`` (needs torch-tensorrt).

    Args:
        max_value: the largest budget or bound drawn; a positive integer.
    """
    check_positive_int("max_value", max_value)
    return _options(max_value)
