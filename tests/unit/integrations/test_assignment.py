"""``assign_items``: which rank encodes which item, for data-parallel encoders.

Properties (Hypothesis, over item lists with frames and world sizes 1..8): every item is assigned
exactly once; the assignment is deterministic; each rank's items are in caller order; no rank is
left idle while another holds two items; the busiest rank's cost is at most ``total / world +
largest item`` (``assignment.py``'s documented bound); a world of 1 is today's plan (rank 0, every
item, caller order). Expected costs are recomputed here from the formula, not read back.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vit_graph_backend.integrations.assignment import DEFAULT_ATTENTION_ROWS, assign_items, item_cost
from vit_graph_backend.errors import InvalidOptionError
from vit_graph_backend.specs import EncoderItemSpec
from vit_graph_backend.testing import item_spec_lists

worlds = st.integers(1, 8)
calls = item_spec_lists(max_size=24, max_tokens=8192, max_frames=8)


def _cost(spec: EncoderItemSpec) -> float:
    rows = spec.input_size / spec.frames
    return spec.input_size + spec.frames * rows * rows / DEFAULT_ATTENTION_ROWS


@given(calls, worlds)
def test_every_item_once_in_caller_order(specs, world):
    result = assign_items(specs, world)
    assert len(result.ranks) == len(result.costs) == world
    flat = [i for items in result.ranks for i in items]
    assert sorted(flat) == list(range(len(specs)))
    assert all(list(items) == sorted(items) for items in result.ranks)
    owner = result.rank_of()
    assert all(i in result.ranks[owner[i]] for i in range(len(specs)))


@given(calls, worlds)
def test_deterministic(specs, world):
    assert assign_items(specs, world) == assign_items(list(specs), world)


@given(calls, worlds)
def test_no_rank_idle_while_another_holds_two(specs, world):
    sizes = [len(items) for items in assign_items(specs, world).ranks]
    if len(specs) >= world:
        assert min(sizes) >= 1, sizes
    else:
        assert sorted(sizes, reverse=True) == [1] * len(specs) + [0] * (world - len(specs))


@given(calls, worlds)
def test_busiest_rank_within_the_documented_bound(specs, world):
    result = assign_items(specs, world)
    costs = [_cost(s) for s in specs]
    for rank, items in enumerate(result.ranks):
        assert result.costs[rank] == pytest.approx(sum(costs[i] for i in items))
    if specs:
        assert max(result.costs) <= sum(costs) / world + max(costs) + 1e-6
    assert 0.0 <= result.imbalance <= 1.0


@given(calls)
def test_world_of_one_is_todays_plan(specs):
    result = assign_items(specs, 1)
    assert result.ranks == (tuple(range(len(specs))),)


def test_a_large_item_and_small_ones_are_balanced():
    # one 4096-row image and eight 512-row ones over two ranks: the large one alone on a rank
    # would cost 4096 + 4096 (attention); the eight small ones 8 * (512 + 64) = 4608
    specs = [EncoderItemSpec(512, 128)] * 4 + [EncoderItemSpec(4096, 1024)] + \
        [EncoderItemSpec(512, 128)] * 4
    result = assign_items(specs, 2)
    assert result.ranks[0] == (4,) and result.costs == (8192.0, 4608.0)
    assert item_cost(EncoderItemSpec(4096, 1024)) == 8192.0


def test_attention_is_per_frame():
    video = EncoderItemSpec(4096, 1024, frames=4)   # four frames of 1024 rows
    assert item_cost(video) == 4096 + 4 * 1024 * 1024 / DEFAULT_ATTENTION_ROWS


@pytest.mark.parametrize("kwargs,match", [
    ({"world_size": 0}, r"world_size=0 is invalid"),
    ({"world_size": 2, "attention_rows": -1}, r"attention_rows=-1 is invalid"),
])
def test_bad_arguments_name_the_value(kwargs, match):
    with pytest.raises(InvalidOptionError, match=match):
        assign_items([EncoderItemSpec(4, 1)], **kwargs)


def test_items_must_be_specs():
    with pytest.raises(InvalidOptionError, match=r"specs\[1\]=\(4, 1\) is invalid"):
        assign_items([EncoderItemSpec(4, 1), (4, 1)], 2)
