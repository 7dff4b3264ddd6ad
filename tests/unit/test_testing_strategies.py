"""The public strategies in vit_graph_backend.testing: valid draws, eager argument checks, docs.

Arguments are themselves drawn, then a value is drawn from the strategy they build, so the checks
cover the whole argument space, not only the defaults.

Hypothesis settings come from the conftest profiles: ``dev`` runs 200 examples per property,
``ci`` (when ``CI`` is set) 300, derandomized.
"""

from __future__ import annotations

import inspect
import re

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

from vit_graph_backend import testing
from vit_graph_backend.budgets import BudgetConfig, budget_ladder
from vit_graph_backend.errors import InvalidOptionError
from vit_graph_backend.specs import EncoderItemSpec
from vit_graph_backend.testing import strategies
from vit_graph_backend.testing.strategies import (
    _budget_config_draws,
    budget_configs,
    budget_ladders,
    budget_ranges,
    image_grids,
    item_spec_lists,
    item_specs,
    token_counts,
)


@st.composite
def bounds(draw, low=1, high=1 << 14):
    """An ordered pair ``low <= a <= b <= high``."""
    a = draw(st.integers(low, high))
    return a, draw(st.integers(a, high))


# max_examples: the conftest profile (200 dev / 300 ci), for each test below.
@given(bounds(), st.data())
def test_token_counts(limits, data):
    n = data.draw(token_counts(*limits))
    assert isinstance(n, int) and limits[0] <= n <= limits[1]


@given(bounds(high=1 << 12), st.integers(1, 8), st.none() | st.integers(1, 4), st.data())
def test_item_specs(limits, max_frames, merge, data):
    spec = data.draw(item_specs(*limits, max_frames=max_frames, merge=merge))
    assert isinstance(spec, EncoderItemSpec)
    assert limits[0] <= spec.output_tokens <= limits[1]
    assert 1 <= spec.frames <= max_frames
    if merge is None:
        assert 1 <= spec.input_size <= 4 * spec.output_tokens
    else:
        assert spec.input_size == spec.output_tokens * merge * merge


@given(bounds(low=0, high=12), bounds(high=64), st.data())
def test_item_spec_lists(sizes, tokens, data):
    specs = data.draw(item_spec_lists(*sizes, min_tokens=tokens[0], max_tokens=tokens[1], merge=1))
    assert sizes[0] <= len(specs) <= sizes[1]
    for spec in specs:  # merge=1, one frame: row items
        assert tokens[0] <= spec.output_tokens == spec.input_size <= tokens[1] and spec.frames == 1


@given(bounds(), st.data())
def test_budget_ranges(limits, data):
    low, high = data.draw(budget_ranges(*limits))
    assert limits[0] <= low <= high <= limits[1]
    BudgetConfig.resolve((low, high))  # a range resolve accepts


@given(bounds(), st.data())
def test_budget_ladders(limits, data):
    ladder = data.draw(budget_ladders(*limits))
    assert limits[0] <= ladder[0] and ladder[-1] <= limits[1]
    assert all(a < b <= 2 * a for a, b in zip(ladder, ladder[1:]))
    assert all(b == 2 * a for a, b in zip(ladder[:-1], ladder[1:-1])), "doubles but the last step"


@given(bounds(), st.integers(1, 16), st.data())
def test_finer_budget_ladders(limits, max_steps, data):
    ladder = data.draw(budget_ladders(*limits, max_steps=max_steps))
    assert limits[0] <= ladder[0] and ladder[-1] <= limits[1]
    assert all(a < b <= 2 * a for a, b in zip(ladder, ladder[1:]))
    assert any(budget_ladder(ladder[0], ladder[-1], k) == ladder for k in range(1, max_steps + 1))


@given(bounds(high=4096), st.integers(1, 8), st.none() | st.integers(1, 16), st.data())
def test_budget_configs(limits, max_budgets, max_frames, data):
    config = data.draw(budget_configs(*limits, max_budgets=max_budgets, max_frames=max_frames))
    assert isinstance(config, BudgetConfig)
    assert 1 <= config.max_batch_size <= config.budgets[0]
    assert list(config.budgets) == sorted(set(config.budgets))
    assert limits[0] <= config.budgets[0] and config.budgets[-1] <= limits[1]
    assert len(config.budgets) <= max(max_budgets, (limits[1] // limits[0]).bit_length() + 1)
    if max_frames is None:
        assert config.max_frames_per_batch is None
    else:
        assert config.max_frames_per_batch is None or 1 <= config.max_frames_per_batch <= max_frames


@given(budget_configs(max_value=8, max_budgets=4))
def test_budget_configs_with_crowded_budgets(config):
    """A narrow value range makes user budgets collide and sit close to max_batch_size."""
    assert 1 <= config.max_batch_size <= config.budgets[0] <= config.budgets[-1] <= 8


@pytest.mark.parametrize("path", [1, 2, 3, 4])
def test_budget_configs_draw_every_resolve_path(path):
    found = find(
        _budget_config_draws(1, 4096, 6, 8), lambda drawn: drawn[0] == path,
        settings=settings(database=None),
    )
    kwargs = found[1]
    assert ("budgets" in kwargs) == (path in (1, 3))
    assert ("max_batch_size" in kwargs) == (path in (1, 2))


@pytest.mark.parametrize(
    "wanted",
    [
        pytest.param(lambda c: c.max_frames_per_batch is not None, id="frame-cap"),
        pytest.param(lambda c: c.max_frames_per_batch is None, id="no-frame-cap"),
        pytest.param(lambda c: len(c.budgets) >= 3 and c.max_batch_size >= 2, id="multi-item-ladder"),
    ],
)
def test_budget_configs_draw_the_shapes_planner_tests_need(wanted):
    find(budget_configs(max_frames=8), wanted, settings=settings(database=None))


@given(st.integers(1, 32), st.integers(1, 8), st.integers(1, 4), st.data())
def test_image_grids(patch, merge, max_frames, data):
    step = patch * merge
    min_side = data.draw(st.none() | st.integers(1, 10 * step), label="min_side")
    low = step if min_side is None else min_side
    max_side = data.draw(st.integers(-(-low // step) * step, 20 * step), label="max_side")
    t, h, w = data.draw(image_grids(patch, merge, min_side, max_side, max_frames))
    assert 1 <= t <= max_frames
    for side in (h, w):
        assert side % merge == 0 and side >= merge
        assert low <= side * patch <= max_side
    # A grid is a valid spec for a packed encoder.
    EncoderItemSpec(t * h * w, t * (h // merge) * (w // merge), t)


# Every argument check, raised when the strategy is *built* (no draw needed).
BAD_ARGUMENTS = [
    (token_counts, dict(min_value=0), r"^min_value=0 is invalid: must be a positive integer"),
    (token_counts, dict(max_value=2.5), r"^max_value=2\.5 is invalid: must be a positive integer, got float$"),
    (token_counts, dict(min_value=5, max_value=3), r"^min_value=5 is larger than max_value=3$"),
    (item_specs, dict(min_tokens=-1), r"^min_tokens=-1 is invalid"),
    (item_specs, dict(max_tokens=True), r"^max_tokens=True is invalid: must be a positive integer, got bool$"),
    (item_specs, dict(min_tokens=5, max_tokens=3), r"^min_tokens=5 is larger than max_tokens=3$"),
    (item_specs, dict(max_frames=0), r"^max_frames=0 is invalid"),
    (item_specs, dict(merge=0), r"^merge=0 is invalid"),
    (item_specs, dict(merge="2"), r"^merge='2' is invalid: must be a positive integer, got str$"),
    (item_spec_lists, dict(min_size=-1), r"^min_size=-1 is invalid: must be a non-negative integer$"),
    (item_spec_lists, dict(max_size=1.0), r"^max_size=1\.0 is invalid: must be a non-negative integer, got float$"),
    (item_spec_lists, dict(min_size=4, max_size=2), r"^min_size=4 is larger than max_size=2$"),
    (item_spec_lists, dict(min_tokens=9, max_tokens=8), r"^min_tokens=9 is larger than max_tokens=8$"),
    (item_spec_lists, dict(merge=-2), r"^merge=-2 is invalid"),
    (budget_ranges, dict(min_value=None), r"^min_value=None is invalid"),
    (budget_ranges, dict(min_value=10, max_value=9), r"^min_value=10 is larger than max_value=9$"),
    (budget_ladders, dict(max_value=0), r"^max_value=0 is invalid"),
    (budget_ladders, dict(max_steps=17), r"^max_steps=17 is invalid"),
    (budget_ladders, dict(min_value=10, max_value=9), r"^min_value=10 is larger than max_value=9$"),
    (budget_configs, dict(min_value=0), r"^min_value=0 is invalid"),
    (budget_configs, dict(min_value=64, max_value=32), r"^min_value=64 is larger than max_value=32$"),
    (budget_configs, dict(max_budgets=0), r"^max_budgets=0 is invalid"),
    (budget_configs, dict(max_frames=0), r"^max_frames=0 is invalid"),
    (image_grids, dict(patch=0), r"^patch=0 is invalid"),
    (image_grids, dict(merge=1.5), r"^merge=1\.5 is invalid: must be a positive integer, got float$"),
    (image_grids, dict(min_side=0), r"^min_side=0 is invalid"),
    (image_grids, dict(max_side=-1), r"^max_side=-1 is invalid"),
    (image_grids, dict(min_side=500, max_side=400), r"^min_side=500 is larger than max_side=400$"),
    (image_grids, dict(max_frames=False), r"^max_frames=False is invalid: must be a positive integer, got bool$"),
    (
        image_grids,
        dict(patch=14, merge=2, min_side=30, max_side=50),
        r"^min_side=30 and max_side=50 hold no multiple of patch \* merge = 14 \* 2 = 28 pixels; "
        r"widen the range or lower patch or merge$",
    ),
    (
        image_grids,
        dict(patch=16, merge=64),
        r"^max_side=896 is smaller than one merged patch, patch \* merge = 16 \* 64 = 1024 pixels; "
        r"raise max_side or lower patch or merge$",
    ),
]


@pytest.mark.parametrize(
    ("strategy", "kwargs", "match"), BAD_ARGUMENTS,
    ids=[f"{s.__name__}-{'-'.join(k)}" for s, k, _ in BAD_ARGUMENTS],
)
def test_bad_arguments_raise_when_the_strategy_is_built(strategy, kwargs, match):
    with pytest.raises(InvalidOptionError, match=match) as info:
        strategy(**kwargs)  # no .example(), no draw: the check is eager
    assert isinstance(info.value, ValueError)


def test_every_strategy_argument_is_documented():
    for name in strategies.__all__:
        function = getattr(strategies, name)
        doc = inspect.getdoc(function)
        assert doc, f"{name} has no docstring"
        assert "Args:" in doc, f"{name} has no Args: section"
        args_section = doc.split("Args:", 1)[1].split("\n\n", 1)[0]
        for parameter in inspect.signature(function).parameters:
            assert re.search(rf"^\s+{parameter}: \S", args_section, re.M), (
                f"{name}: argument {parameter!r} has no entry under Args:"
            )


def test_public_surface():
    assert testing.__all__ == sorted(testing.__all__)
    assert strategies.__all__ == sorted(strategies.__all__)
    # the strategies, and the conformance check of a packed tower's adapter
    assert testing.__all__ == sorted([*strategies.__all__, "AdapterCheckError", "check_adapter"])
    for name in strategies.__all__:
        assert getattr(testing, name) is getattr(strategies, name)
        assert isinstance(getattr(strategies, name)(), st.SearchStrategy), "defaults build a strategy"
    assert issubclass(testing.AdapterCheckError, AssertionError) and callable(testing.check_adapter)


@given(st.integers(1, 4096), st.data())
def test_vitgraph_options_are_valid_and_round_trip(max_value, data):
    from vit_graph_backend.options import VitGraphOptions
    from vit_graph_backend.testing import vitgraph_options

    opts = data.draw(vitgraph_options(max_value))
    assert isinstance(opts, VitGraphOptions)
    again = VitGraphOptions.from_dict(opts.to_dict())  # re-validates every field
    assert again == opts and hash(again) == hash(opts)
    assert opts.inner_compiler != "tensorrt"
    if opts.budgets is not None:
        assert max(opts.budgets) <= max_value
        if opts.max_items_per_graph is not None:
            assert opts.max_items_per_graph <= min(opts.budgets)


@pytest.mark.slow
def test_vitgraph_options_strategy_draws_every_choice():
    from hypothesis import find

    from vit_graph_backend.testing import vitgraph_options

    for pred in (lambda o: o.budgets is None, lambda o: o.budgets is not None,
                 lambda o: o.policy == "exact", lambda o: o.inner_compiler == "inductor",
                 lambda o: o.ladder_steps == 16, lambda o: o.capture == "lazy"):
        find(vitgraph_options(64), pred)
    with pytest.raises(InvalidOptionError, match=r"^max_value=0 is invalid"):
        vitgraph_options(0)
