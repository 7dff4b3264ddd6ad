"""Budgets: the ladder, BudgetConfig.resolve's four paths, ceil sizing of capture slots.

Expectations are derived from the rules in ``BudgetConfig.resolve``'s docstring, written out again here as small
reference functions, not read back from the code under test.

Hypothesis settings come from the conftest profiles: ``dev`` runs 200 examples per property,
``ci`` (when ``CI`` is set) 300, derandomized.
"""

from __future__ import annotations

import doctest
import re
from fractions import Fraction
from math import ceil

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

from vit_graph_backend import budgets
from vit_graph_backend.budgets import (
    BudgetConfig,
    CaptureLayout,
    budget_ladder,
    capture_layout,
    ceil_div,
    smallest_fitting,
)
from vit_graph_backend.errors import InvalidOptionError
from vit_graph_backend.testing import budget_ladders, budget_ranges

values = st.integers(1, 1 << 20)
small = st.integers(1, 64)
#: Never a positive integer.
bad_ints = st.one_of(
    st.integers(max_value=0), st.booleans(), st.floats(allow_nan=False), st.just("8"), st.just(8.0)
)


def reference_ladder(start: int, stop: int) -> list[int]:
    """The ladder doubles from its start and always ends exactly at ``stop``."""
    ladder = [start * 2**k for k in range(stop.bit_length() + 1) if start * 2**k < stop]
    return ladder + [stop]


# --- ceil_div and budget_ladder -------------------------------------------------------------


# max_examples: the conftest profile (200 dev / 300 ci).
@given(st.integers(0, 1 << 80), st.integers(1, 1 << 40))
def test_ceil_div_is_exact_ceiling(total, parts):
    assert ceil_div(total, parts) == ceil(Fraction(total, parts))


# max_examples: the conftest profile (200 dev / 300 ci).
@given(values, values)
def test_budget_ladder_shape(a, b):
    start, stop = min(a, b), max(a, b)
    ladder = budget_ladder(start, stop)
    assert ladder[0] == start
    assert ladder[-1] == stop
    assert all(x < y for x, y in zip(ladder, ladder[1:])), "strictly increasing"
    assert all(y <= 2 * x for x, y in zip(ladder, ladder[1:])), "each step at most doubles"
    assert all(y == 2 * x for x, y in zip(ladder[:-1], ladder[1:-1])), "doubles but the last step"
    assert list(ladder) == reference_ladder(start, stop)


# max_examples: the conftest profile (200 dev / 300 ci).
@given(values, values, st.integers(1, 16))
def test_finer_ladders_bound_each_step_and_refine_the_doubling_ladder(a, b, k):
    start, stop = min(a, b), max(a, b)
    ladder = budget_ladder(start, stop, k)
    assert ladder[0] == start and ladder[-1] == stop
    assert all(x < y for x, y in zip(ladder, ladder[1:])), "strictly increasing"
    # padding bound: a batch of x + 1 tokens pads to at most x + ceil(x / k)
    assert all(y - x <= ceil_div(x, k) for x, y in zip(ladder, ladder[1:]))
    assert set(budget_ladder(start, stop)) <= set(ladder), "keeps every doubling"
    assert set(ladder) <= set(budget_ladder(start, stop, 2 * k)) if 2 * k <= 16 else True
    doublings = len(budget_ladder(start, stop)) - 1
    assert len(ladder) <= k * doublings + 1


def test_finer_ladder_examples():
    assert budget_ladder(1, 32, 2) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
    assert budget_ladder(1, 32, 4) == (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32)
    assert budget_ladder(64, 1000, 2) == (64, 96, 128, 192, 256, 384, 512, 768, 1000)
    with pytest.raises(InvalidOptionError, match=r"^ladder_steps=17 is invalid: must be an "
                                                 r"integer in 1\.\.16"):
        budget_ladder(1, 8, 17)
    with pytest.raises(InvalidOptionError, match=r"^ladder_steps=0 is invalid"):
        BudgetConfig.resolve((1, 8), ladder_steps=0)
    assert BudgetConfig.resolve((64, 512), ladder_steps=2).budgets == (64, 96, 128, 192, 256,
                                                                        384, 512)


# max_examples: the conftest profile (200 dev / 300 ci).
@given(values, values)
def test_budget_ladder_rejects_start_above_stop(a, b):
    start, stop = max(a, b) + 1, min(a, b)
    with pytest.raises(InvalidOptionError, match=rf"^ladder start={start} is larger than ladder stop={stop}"):
        budget_ladder(start, stop)


# max_examples: the conftest profile (200 dev / 300 ci).
@given(budget_ladders(), st.integers(1, 5000))
def test_smallest_fitting_is_the_smallest_budget_that_holds(ladder, tokens):
    fitting = [b for b in ladder if b >= tokens]
    assert smallest_fitting(ladder, tokens) == (min(fitting) if fitting else None)


# --- BudgetConfig.resolve ---------------------------------------------------------------------


def expected_resolution(budget_range, budgets, max_batch_size):
    """The four paths of ``BudgetConfig.resolve``: ``(budgets, max_batch_size)``, or ``None`` where it must raise."""
    min_budget, max_budget = budget_range
    if budgets is not None and max_batch_size is not None:  # path 1: keep both
        user = sorted(set(budgets))
        return None if max_batch_size > user[0] else (user, max_batch_size)
    if max_batch_size is not None:  # path 2: a ladder from max(min_budget, max_batch_size)
        start = max(min_budget, max_batch_size)
        return None if start > max_budget else (reference_ladder(start, max_budget), max_batch_size)
    if budgets is not None:  # path 3
        user = sorted(set(budgets))
        return user, min(max_budget // min_budget, user[0])
    ladder = reference_ladder(min_budget, max_budget)  # path 4
    return ladder, min(max_budget // min_budget, ladder[0])


user_budget_lists = st.none() | st.lists(st.integers(1, 300), min_size=1, max_size=6)


# max_examples: the conftest profile (200 dev / 300 ci).
@given(
    budget_ranges(max_value=300),
    user_budget_lists,
    st.none() | st.integers(1, 400),
    st.none() | st.integers(1, 64),
)
def test_resolve_follows_the_four_paths(budget_range, user_budgets, max_batch_size, frame_cap):
    expected = expected_resolution(budget_range, user_budgets, max_batch_size)
    call = lambda: BudgetConfig.resolve(  # noqa: E731
        budget_range, budgets=user_budgets, max_batch_size=max_batch_size,
        max_frames_per_batch=frame_cap,
    )
    if expected is None:
        with pytest.raises(InvalidOptionError, match=rf"^max_batch_size={max_batch_size} is larger"):
            call()
        return
    config = call()
    assert list(config.budgets) == expected[0]
    assert config.max_batch_size == expected[1]
    assert config.max_frames_per_batch == frame_cap
    # The invariant every path keeps, and the shape of the budgets.
    assert 1 <= config.max_batch_size <= min(config.budgets)
    assert list(config.budgets) == sorted(set(config.budgets))
    assert config.max_budget == config.budgets[-1]
    assert isinstance(config.budgets, tuple)


# max_examples: the conftest profile (200 dev / 300 ci).
@given(budget_ranges(max_value=1 << 16), st.integers(1, 1 << 16))
def test_resolve_path2_ladder_starts_at_max_of_min_budget_and_batch(budget_range, max_batch_size):
    min_budget, max_budget = budget_range
    if max_batch_size > max_budget:
        with pytest.raises(InvalidOptionError, match=rf"larger than max_budget={max_budget}"):
            BudgetConfig.resolve(budget_range, max_batch_size=max_batch_size)
        return
    config = BudgetConfig.resolve(budget_range, max_batch_size=max_batch_size)
    assert config.budgets[0] == max(min_budget, max_batch_size)
    assert config.budgets[-1] == max_budget
    assert config.max_batch_size == max_batch_size


# max_examples: the conftest profile (200 dev / 300 ci).
@given(budget_ranges(max_value=1 << 16), st.none() | st.lists(values, min_size=1, max_size=8))
def test_resolve_paths_3_and_4_derive_max_batch_size(budget_range, user_budgets):
    min_budget, max_budget = budget_range
    config = BudgetConfig.resolve(budget_range, budgets=user_budgets)
    assert config.max_batch_size == min(max_budget // min_budget, min(config.budgets))
    if user_budgets is None:
        assert (config.budgets[0], config.budgets[-1]) == budget_range
    else:
        assert config.budgets == tuple(sorted(set(user_budgets)))


# max_examples: the conftest profile (200 dev / 300 ci).
@given(values, values, user_budget_lists, st.none() | st.integers(1, 400))
def test_resolve_rejects_an_inverted_range_on_every_path(a, b, user_budgets, max_batch_size):
    low, high = min(a, b), max(a, b) + 1
    with pytest.raises(InvalidOptionError, match=rf"^min_budget={high} is larger than max_budget={low}$"):
        BudgetConfig.resolve((high, low), budgets=user_budgets, max_batch_size=max_batch_size)


FIELD_CALLS = {
    "min_budget": lambda v: BudgetConfig.resolve((v, 64)),
    "max_budget": lambda v: BudgetConfig.resolve((1, v)),
    "budgets[1]": lambda v: BudgetConfig.resolve((1, 64), budgets=[8, v]),
    "max_batch_size": lambda v: BudgetConfig.resolve((1, 64), max_batch_size=v),
    "max_frames_per_batch": lambda v: BudgetConfig.resolve((1, 64), max_frames_per_batch=v),
}


# max_examples: the conftest profile (200 dev / 300 ci).
@given(st.sampled_from(sorted(FIELD_CALLS)), bad_ints)
def test_resolve_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(InvalidOptionError, match="^" + re.escape(f"{field}=")) as info:
        FIELD_CALLS[field](value)
    assert isinstance(info.value, ValueError)


# Every message budgets.py can raise, one row each.
BAD_BUDGETS = [
    (lambda: budget_ladder(0, 8), r"^ladder start=0 is invalid: must be a positive integer \(>= 1\)$"),
    (lambda: budget_ladder(8, True), r"^ladder stop=True is invalid: must be a positive integer, got bool$"),
    (lambda: budget_ladder(9, 8), r"^ladder start=9 is larger than ladder stop=8: a budget ladder must start"),
    (lambda: BudgetConfig.resolve(64), r"^budget_range=64 is invalid: must be a pair \(min_budget, max_budget\)$"),
    (lambda: BudgetConfig.resolve((1, 2, 3)), r"^budget_range=\(1, 2, 3\) is invalid: must be a pair"),
    (lambda: BudgetConfig.resolve((0, 8)), r"^min_budget=0 is invalid: must be a positive integer"),
    (lambda: BudgetConfig.resolve((8, 8.5)), r"^max_budget=8\.5 is invalid: must be a positive integer, got float$"),
    (lambda: BudgetConfig.resolve((64, 32)), r"^min_budget=64 is larger than max_budget=32$"),
    (lambda: BudgetConfig.resolve((1, 8), budgets=[]), r"^budgets=\[\] is invalid: give at least one positive integer$"),
    (lambda: BudgetConfig.resolve((1, 8), budgets="64"), r"^budgets='64' is invalid: must be a sequence of positive integers$"),
    (lambda: BudgetConfig.resolve((1, 8), budgets=64), r"^budgets=64 is invalid: must be a sequence of positive integers$"),
    (lambda: BudgetConfig.resolve((1, 8), budgets=[4, -1]), r"^budgets\[1\]=-1 is invalid: must be a positive integer"),
    (lambda: BudgetConfig.resolve((1, 8), budgets=[True]), r"^budgets\[0\]=True is invalid: must be a positive integer, got bool$"),
    (lambda: BudgetConfig.resolve((1, 8), max_batch_size=0), r"^max_batch_size=0 is invalid: must be a positive integer"),
    (lambda: BudgetConfig.resolve((1, 8), max_frames_per_batch=-2), r"^max_frames_per_batch=-2 is invalid"),
    (
        lambda: BudgetConfig.resolve((1, 1024), budgets=[64, 128], max_batch_size=256),
        r"^max_batch_size=256 is larger than the smallest budget min\(budgets\)=64: every item slot "
        r"of a graph needs at least one token; lower max_batch_size or raise the smallest budget$",
    ),
    (
        lambda: BudgetConfig.resolve((64, 1000), max_batch_size=1001),
        r"^max_batch_size=1001 is larger than max_budget=1000: no budget can give every item slot "
        r"a token; lower max_batch_size$",
    ),
    # The constructor checks again, so a hand-built config cannot break the invariant.
    (
        lambda: BudgetConfig((128, 64), 1),
        r"^budgets=\(128, 64\) is invalid: must be sorted, unique and positive; "
        r"use BudgetConfig\.resolve\(\)",
    ),
    (lambda: BudgetConfig((64, 64), 1), r"^budgets=\(64, 64\) is invalid: must be sorted, unique"),
    (lambda: BudgetConfig((), 1), r"^budgets=\[\] is invalid: give at least one positive integer$"),
    (lambda: BudgetConfig((0, 64), 1), r"^budgets\[0\]=0 is invalid"),
    (lambda: BudgetConfig((64,), 0), r"^max_batch_size=0 is invalid"),
    (lambda: BudgetConfig((64,), 8, 0), r"^max_frames_per_batch=0 is invalid"),
    (
        lambda: BudgetConfig((64, 128), 65),
        r"^max_batch_size=65 is larger than the smallest budget min\(budgets\)=64: every item slot of a graph "
        r"needs at least one token; lower max_batch_size or raise the smallest budget$",
    ),
    (lambda: capture_layout(0, 1), r"^budget=0 is invalid: must be a positive integer"),
    (lambda: capture_layout(64, 1.5), r"^max_batch_size=1\.5 is invalid: must be a positive integer, got float$"),
    (lambda: capture_layout(64, 8, False), r"^max_frames_per_batch=False is invalid: must be a positive integer, got bool$"),
    (lambda: capture_layout(64, 65), r"^max_batch_size=65 is larger than budget=64: a slot would get no token$"),
]


@pytest.mark.parametrize(
    ("call", "match"), BAD_BUDGETS, ids=[re.sub(r"[\\^$]", "", m)[:48] for _, m in BAD_BUDGETS]
)
def test_bad_budget_messages(call, match):
    with pytest.raises(InvalidOptionError, match=match) as info:
        call()
    assert isinstance(info.value, ValueError)


# max_examples: the conftest profile (200 dev / 300 ci).
@given(budget_ladders(max_value=512), st.data())
def test_hand_built_config_holds_the_invariant(ladder, data):
    max_batch_size = data.draw(st.integers(1, 2 * ladder[0]), label="max_batch_size")
    if max_batch_size > ladder[0]:
        with pytest.raises(InvalidOptionError, match=rf"^max_batch_size={max_batch_size} is larger"):
            BudgetConfig(ladder, max_batch_size)
    else:
        assert BudgetConfig(ladder, max_batch_size).max_batch_size == max_batch_size


def test_hand_built_config_stores_a_tuple_and_hashes():
    """A list of budgets is accepted and stored as a tuple, so the config can key a cache."""
    from_list = BudgetConfig([64, 128], 8)
    assert from_list.budgets == (64, 128)
    assert from_list == BudgetConfig((64, 128), 8)
    assert hash(from_list) == hash(BudgetConfig((64, 128), 8))


# --- capture_layout: ceil division ------------------------------------------------------------


@st.composite
def layouts(draw, max_budget=1 << 20):
    budget = draw(st.integers(1, max_budget), label="budget")
    slots = draw(st.integers(1, budget), label="slots")
    frames = draw(st.none() | st.integers(1, 1 << 12), label="max_frames_per_batch")
    return budget, slots, frames


# max_examples: the conftest profile (200 dev / 300 ci).
@given(layouts())
def test_capture_layout_is_ceil_sized(args):
    budget, slots, frames = args
    layout = capture_layout(budget, slots, frames)
    assert (layout.budget, layout.slots) == (budget, slots)
    # Holds the budget ...
    assert layout.tokens_per_slot >= 1
    assert layout.capacity == slots * layout.tokens_per_slot >= budget
    # ... with the fewest tokens a slot that does (ceil, not more).
    assert slots * (layout.tokens_per_slot - 1) < budget
    # Same for frames: the slots hold the frame cap, minimally; one frame a slot for images.
    assert layout.frames_per_slot >= 1
    if frames is None:
        assert layout.frames_per_slot == 1
    else:
        assert slots * layout.frames_per_slot >= frames
        assert layout.frames_per_slot == 1 or slots * (layout.frames_per_slot - 1) < frames


def test_floor_division_would_under_allocate():
    """The bug ceil sizing fixes exists: Hypothesis finds a (budget, slots) floor division fails.

    Floor gives ``slots * (budget // slots) < budget`` whenever ``slots`` does not divide
    ``budget``; the search shrinks to the smallest such case, and ceil sizing holds there.
    """

    def floor_fails(args):
        budget, slots, _ = args
        return slots * (budget // slots) < budget

    budget, slots, frames = find(layouts(max_budget=4096), floor_fails, settings=settings(database=None))
    assert (budget, slots) == (3, 2)  # the minimal counterexample
    assert capture_layout(budget, slots, frames).capacity >= budget
    # The case from the design notes: 800 tokens over 64 slots.
    assert 64 * (800 // 64) == 768 < 800
    assert capture_layout(800, 64) == CaptureLayout(800, 64, 13, 1)


def test_docstring_examples():
    result = doctest.testmod(budgets, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_one_message_for_the_items_invariant_under_each_name():
    """Options, BudgetConfig.resolve and a hand-built BudgetConfig raise the same sentence, each
    with the name its caller knows."""
    from vit_graph_backend import VitGraphOptions

    expected = ("max_items_per_graph=8 is larger than the smallest budget min(budgets)=4: every "
                "item slot of a graph needs at least one token; lower max_items_per_graph or raise "
                "the smallest budget")
    with pytest.raises(InvalidOptionError) as opt:
        VitGraphOptions(budgets=(4, 16), max_items_per_graph=8)
    with pytest.raises(InvalidOptionError) as res:
        BudgetConfig.resolve((1, 16), budgets=(4, 16), max_batch_size=8,
                             items_name="max_items_per_graph")
    assert str(opt.value) == str(res.value) == expected
    with pytest.raises(InvalidOptionError) as hand:
        BudgetConfig((4, 16), 8)
    assert str(hand.value) == expected.replace("max_items_per_graph", "max_batch_size")
