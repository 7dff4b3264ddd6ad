"""plan_batches: the invariants in ``planner.py``'s docstring, for both policies, chunked or not.

One checker, :func:`check_plan`, states every invariant; the property tests feed it plans drawn
from the package's own strategies (configs through all four ``BudgetConfig.resolve`` paths, with
and without a frame cap). Expected values are recomputed here from the rules, never read back
from the planner.

Hypothesis settings come from the conftest profiles: ``dev`` runs 200 examples per property,
``ci`` (when ``CI`` is set) 300, derandomized.
"""

from __future__ import annotations

import doctest
from collections import defaultdict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vit_graph_backend import planner
from vit_graph_backend.budgets import BudgetConfig
from vit_graph_backend.errors import InvalidOptionError
from vit_graph_backend.planner import POLICIES, Batch, Plan, Segment, plan_batches
from vit_graph_backend.specs import EncoderItemSpec
from vit_graph_backend.testing import budget_configs, budget_ladders, item_spec_lists


def run_in_execution_order(plan: Plan, specs) -> list[int]:
    """Simulate the runtime: walk the batches in order, emit an item once all its tokens ran."""
    done = [0] * len(specs)
    emitted = []
    for batch in plan.batches:
        for seg in batch.segments:
            done[seg.item] += seg.tokens
            if done[seg.item] == specs[seg.item].output_tokens:
                emitted.append(seg.item)
    return emitted


def segment_frames(seg: Segment, specs) -> int:
    # Chunk pieces come only from row items, which have one frame; whole items carry their own.
    return specs[seg.item].frames


def doesnt_fit_after(batch: Batch, seg: Segment, specs, config: BudgetConfig) -> bool:
    """Baseline packing: ``seg`` would have broken a cap had it joined ``batch``."""
    cap = config.max_frames_per_batch
    return (
        batch.tokens + seg.tokens > config.max_budget
        or len(batch.segments) >= config.max_batch_size
        or (cap is not None and batch.frames + segment_frames(seg, specs) > cap)
    )


def check_plan(specs, config: BudgetConfig, plan: Plan, policy: str, chunk: bool) -> None:
    budgets = config.budgets
    cap = config.max_frames_per_batch
    n = len(specs)
    assert plan.num_items == n

    # Every item's output tokens are covered exactly once: its segments partition [0, tokens).
    pieces = defaultdict(list)
    for batch in plan.batches:
        for seg in batch.segments:
            assert 0 <= seg.item < n
            assert 0 <= seg.start < seg.stop, seg
            pieces[seg.item].append(seg)
    assert sorted(pieces) == list(range(n)), "every item appears"
    for item, segs in pieces.items():
        segs.sort(key=lambda s: s.start)
        assert segs[0].start == 0
        assert all(a.stop == b.start for a, b in zip(segs, segs[1:])), segs
        assert segs[-1].stop == specs[item].output_tokens
        if not chunk:
            assert len(segs) == 1, "without chunking an item is in exactly one batch"

    for batch in plan.batches:
        assert batch.segments, "no empty batch"
        assert len(batch.segments) <= config.max_batch_size
        assert batch.frames == sum(segment_frames(s, specs) for s in batch.segments)
        assert batch.padded_tokens >= 0
        if batch.eager:
            assert batch.padded_tokens == 0
            continue
        assert batch.budget in budgets
        assert batch.tokens <= batch.budget
        if cap is not None:
            assert batch.frames <= cap
        # Padding is below the gap to the next smaller budget: the batch fits no smaller graph.
        smaller = [b for b in budgets if b < batch.budget]
        assert batch.padded_tokens < batch.budget - (smaller[-1] if smaller else 0)
        if policy == "baseline":  # the chosen budget is the smallest one that holds the batch
            assert batch.budget == min(b for b in budgets if b >= batch.tokens)
        else:  # exact: never any padding
            assert batch.tokens == batch.budget

    if policy == "exact":
        assert plan.padded_tokens == 0
        assert plan.padding_ratio == 0.0
        # A whole item (or chunk) that equals a budget replays alone.
        for batch in plan.batches:
            for seg in batch.segments:
                if seg.tokens in budgets and (cap is None or segment_frames(seg, specs) <= cap):
                    assert batch.segments == (seg,) and batch.budget == seg.tokens

    # Eager only for what no graph can hold alone.
    for item in plan.eager_items:
        spec = specs[item]
        alone_too_big = spec.output_tokens > config.max_budget
        alone_too_many_frames = cap is not None and spec.frames > cap
        if policy == "baseline":
            assert alone_too_big or alone_too_many_frames, (item, spec)
            if chunk:
                raise AssertionError(f"row item {item} ({spec}) ran eagerly although chunk=True")

    # Chunking cuts full largest-budget chunks plus one remainder (baseline), or budget-sized
    # pieces plus a remainder below the smallest budget (exact).
    if chunk:
        for item, segs in pieces.items():
            sizes = sorted((s.tokens for s in segs), reverse=True)
            if policy == "baseline" and len(segs) > 1:
                assert all(size == config.max_budget for size in sizes[:-1]), sizes
                assert len(segs) == -(-specs[item].output_tokens // config.max_budget)
            if policy == "exact":
                off_ladder = [size for size in sizes if size not in budgets]
                assert len(off_ladder) <= 1 and all(size < budgets[0] for size in off_ladder), sizes

    # Greedy packing (fill a batch while it fits): the unit that opened the next packed
    # batch would not have fit the previous one. Batches set aside (oversize, or exact-size units
    # under the exact policy) are not part of the packing sequence.
    def set_aside(batch: Batch) -> bool:
        seg = batch.segments[0]
        if len(batch.segments) == 1 and (
            seg.tokens > config.max_budget
            or (cap is not None and segment_frames(seg, specs) > cap)
        ):
            return True
        return policy == "exact" and len(batch.segments) == 1 and batch.budget == seg.tokens

    packed = [b for b in plan.batches if not set_aside(b)]
    for previous, following in zip(packed, packed[1:]):
        assert doesnt_fit_after(previous, following.segments[0], specs, config), (previous, following)
    if policy == "baseline":  # smallest first
        sizes = [s.tokens for b in packed for s in b.segments]
        assert sizes == sorted(sizes)

    # Outputs come back in the caller's order.
    assert sorted(plan.restore_order) == list(range(n))
    assert plan.restore(run_in_execution_order(plan, specs)) == list(range(n))
    assert list(plan.execution_order) == run_in_execution_order(plan, specs)

    # Padding accounting.
    graph = plan.graph_batches
    assert plan.real_tokens == sum(b.tokens for b in graph)
    assert plan.padded_tokens == sum(b.budget - b.tokens for b in graph) >= 0
    assert 0.0 <= plan.padding_ratio < 1.0
    if graph:
        total = sum(b.budget for b in graph)
        assert plan.padding_ratio == pytest.approx(plan.padded_tokens / total)


#: Built once: building a strategy costs more than drawing from it.
CONFIGS = {False: budget_configs(max_value=512, max_frames=6), True: budget_configs(max_value=512)}
FRAMES, MERGES = st.integers(1, 8), st.integers(1, 2)


@st.composite
def planning_cases(draw, chunk: bool):
    """A config and the specs of one call, sized around the config's budgets."""
    config = draw(CONFIGS[chunk], label="config")
    # Tiny items (so the item cap binds), halves and quarters of budgets (so batches fill a budget
    # exactly), items that fit, and oversize items up to 3x the largest budget.
    tokens = st.one_of(
        st.integers(1, 4),
        st.builds(lambda b, k: max(1, b >> k), st.sampled_from(config.budgets), st.integers(0, 2)),
        st.integers(1, config.max_budget),
        st.integers(1, 3 * config.max_budget),
    )
    if chunk:  # chunk=True is for row items: one frame, input_size == output_tokens
        item = tokens.map(lambda t: EncoderItemSpec(t, t, 1))
    else:
        item = st.builds(lambda t, f, m: EncoderItemSpec(t * m * m, t, f), tokens, FRAMES, MERGES)
    specs = draw(st.lists(item, max_size=32), label="specs")
    return config, specs


# max_examples: the conftest profile (200 dev / 300 ci), for each policy.
@pytest.mark.parametrize("policy", POLICIES)
@given(case=planning_cases(chunk=False))
def test_plan_invariants(policy, case):
    config, specs = case
    plan = plan_batches(specs, config, policy=policy)
    check_plan(specs, config, plan, policy, chunk=False)
    assert plan_batches(specs, config, policy=policy) == plan, "deterministic"
    if policy == "baseline" and all(s.output_tokens <= config.max_budget for s in specs):
        # chunk only changes oversize items under the baseline policy; row-ness does not matter.
        assert plan_batches(specs, config, chunk=True) == plan


# max_examples: the conftest profile (200 dev / 300 ci), for each policy.
@pytest.mark.parametrize("policy", POLICIES)
@given(case=planning_cases(chunk=True))
def test_plan_invariants_chunked(policy, case):
    config, specs = case
    check_plan(specs, config, plan_batches(specs, config, policy=policy, chunk=True), policy, chunk=True)


# max_examples: the conftest profile (200 dev / 300 ci).
@given(
    budget_configs(max_value=256, max_frames=4),
    item_spec_lists(max_size=12, max_tokens=300, max_frames=4, merge=2),
)
def test_plan_invariants_from_public_strategies(config, specs):
    for policy in POLICIES:
        check_plan(specs, config, plan_batches(specs, config, policy=policy), policy, chunk=False)


@st.composite
def partitions(draw, total: int, parts: int) -> list[int]:
    """``parts`` positive integers summing to ``total`` (``1 <= parts <= total``)."""
    if parts == 1:
        return [total]
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), min_size=parts - 1, max_size=parts - 1)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


@st.composite
def exact_fills(draw, cap: str):
    """A hand-built config and items that together reach one cap exactly and break no other."""
    ladder = draw(budget_ladders(max_value=512), label="budgets")
    max_batch_size = draw(st.integers(1, ladder[0]), label="max_batch_size")
    if cap == "tokens":  # k items whose tokens sum to the largest budget
        frame_cap = None
        k = draw(st.integers(1, min(max_batch_size, ladder[-1])), label="items")
        total, frames = ladder[-1], [1] * k
    else:  # k one-token items whose frames sum to the frame cap
        frame_cap = draw(st.integers(1, 64), label="max_frames_per_batch")
        k = draw(st.integers(1, min(max_batch_size, frame_cap)), label="items")
        total = k
        frames = draw(partitions(frame_cap, k))
    tokens = draw(partitions(total, k))
    specs = [EncoderItemSpec(t, t, f) for t, f in zip(tokens, frames)]
    return BudgetConfig(ladder, max_batch_size, frame_cap), draw(st.permutations(specs))


# max_examples: the conftest profile (200 dev / 300 ci), for each cap.
@pytest.mark.parametrize("cap", ["tokens", "frames"])
@given(data=st.data())
def test_items_that_exactly_reach_a_cap_share_one_graph(cap, data):
    """'Fill a batch while it fits' means fits *or equals*: a cap reached exactly is not exceeded."""
    config, specs = data.draw(exact_fills(cap))
    plan = plan_batches(specs, config)
    assert len(plan.batches) == 1, plan.batches
    (batch,) = plan.batches
    assert sorted(batch.items) == list(range(len(specs)))
    if cap == "tokens":
        assert batch.budget == batch.tokens == config.max_budget
    else:
        assert batch.frames == config.max_frames_per_batch
    check_plan(specs, config, plan, "baseline", chunk=False)


# --- examples -------------------------------------------------------------------------------


def test_exact_chunks_a_batched_call_into_budget_sized_graphs():
    config = BudgetConfig.resolve((1, 16), budgets=(1, 2, 4, 8, 16), max_batch_size=1)
    plan = plan_batches([EncoderItemSpec(12, 12)], config, policy="exact", chunk=True)
    assert sorted(b.budget for b in plan.batches) == [4, 8]
    assert plan.padded_tokens == 0


def test_oversize_items_run_last_and_eagerly():
    config = BudgetConfig.resolve((64, 256), max_batch_size=4)
    specs = [EncoderItemSpec(4096, 1024), EncoderItemSpec(256, 64)]
    plan = plan_batches(specs, config)
    assert [(b.items, b.budget) for b in plan.batches] == [((1,), 64), ((0,), None)]
    assert plan.eager_items == (0,)
    assert plan.restore(["small", "big"]) == ["big", "small"]


def test_empty_call_gives_an_empty_plan():
    plan = plan_batches([], BudgetConfig.resolve((1, 8)))
    assert plan.batches == () and plan.restore([]) == [] and plan.padding_ratio == 0.0


BAD_PLANS = [
    (
        lambda: plan_batches([], BudgetConfig.resolve((1, 8)), policy="fastest"),
        InvalidOptionError,
        r"^policy='fastest' is invalid: must be one of \('baseline', 'exact'\)$",
    ),
    (
        lambda: plan_batches([EncoderItemSpec(4 * 100, 100)], BudgetConfig.resolve((1, 64)), chunk=True),
        InvalidOptionError,
        r"^chunk=True needs row items \(input_size == output_tokens, frames == 1\); item 0 has "
        r"EncoderItemSpec\(input_size=400, output_tokens=100, frames=1\): packed items cannot be "
        r"split, use chunk=False$",
    ),
    (
        lambda: plan_batches(
            [EncoderItemSpec(8, 8, frames=2)], BudgetConfig.resolve((1, 64)), policy="exact", chunk=True
        ),
        InvalidOptionError,
        r"^chunk=True needs row items .* item 0 has EncoderItemSpec\(input_size=8, output_tokens=8, frames=2\)",
    ),
    (
        lambda: plan_batches([EncoderItemSpec(1, 1)], BudgetConfig.resolve((1, 8))).restore([1, 2]),
        ValueError,
        r"^got 2 outputs for a plan of 1 items$",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "match"), BAD_PLANS, ids=["policy", "packed-chunk", "video-chunk", "restore"]
)
def test_bad_plan_messages(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert isinstance(info.value, ValueError)


def test_docstring_examples():
    result = doctest.testmod(planner, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
