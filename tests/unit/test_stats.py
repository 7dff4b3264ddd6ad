"""GraphStats: counters add up, merge adds, reset zeros, concurrent updates are not lost.

Expected totals are recomputed from the recorded operations, not read back from the counters.

Hypothesis settings come from the conftest profiles: ``dev`` runs 200 examples per property,
``ci`` (when ``CI`` is set) 300, derandomized.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vit_graph_backend.planner import plan_batches
from vit_graph_backend.stats import GraphStats
from vit_graph_backend.testing import budget_configs, item_spec_lists

REASONS = ("oversize", "no graph", "capture failed")


@st.composite
def replays(draw):
    budget = draw(st.integers(1, 4096))
    return ("replay", budget, draw(st.integers(1, budget)), draw(st.integers(1, budget)),
            draw(st.booleans()))


eagers = st.tuples(st.just("eager"), st.integers(1, 64), st.sampled_from(REASONS))
exacts = st.tuples(st.just("exact"), st.integers(1, 64), st.booleans())
calls = st.tuples(st.just("call"))
operations = st.lists(st.one_of(replays(), eagers, exacts, calls), max_size=25)


def apply(stats: GraphStats, ops) -> GraphStats:
    for op in ops:
        if op[0] == "replay":
            stats.record_replay(op[1], op[2], op[3], graph=op[4])
        elif op[0] == "exact":
            stats.record_exact(op[1], graph=op[2])
        elif op[0] == "eager":
            stats.record_eager(op[1], op[2])
        else:
            stats.record_call()
    return stats


def expected_counts(ops) -> dict:
    rep = [op for op in ops if op[0] == "replay"]
    ex = [op for op in ops if op[0] == "exact"]
    eag = [op for op in ops if op[0] == "eager"]
    # (items, graph?) of every padded or exact-shape batch
    runs = [(op[2], op[4]) for op in rep] + [(1, op[2]) for op in ex]
    graph_items = sum(n for n, g in runs if g)
    no_graph_items = sum(n for n, g in runs if not g)
    eager_items = sum(op[1] for op in eag)
    real = sum(op[3] for op in rep) + sum(op[1] for op in ex)
    padded = sum(op[1] - op[3] for op in rep)
    served = graph_items + no_graph_items + eager_items
    return {
        "calls": sum(op[0] == "call" for op in ops),
        "graph_replays": sum(1 for _, g in runs if g),
        "graph_items": graph_items,
        "no_graph_batches": sum(1 for _, g in runs if not g),
        "no_graph_items": no_graph_items,
        "eager_batches": len(eag),
        "eager_items": eager_items,
        "exact_shape_batches": len(ex),
        "real_tokens": real,
        "padded_tokens": padded,
        "hit_rate": graph_items / served if served else 0.0,
        "padding_ratio": padded / (real + padded) if real + padded else 0.0,
        "batches_per_budget": {str(b): n for b, n in sorted(Counter(op[1] for op in rep).items())},
        "fallback_reasons": dict(Counter(op[2] for op in eag)),
    }


# max_examples: the conftest profile (200 dev / 300 ci).
@given(operations)
def test_counters_add_up(ops):
    stats = apply(GraphStats(), ops)
    snapshot, expected = stats.as_dict(), expected_counts(ops)
    for ratio in ("hit_rate", "padding_ratio"):
        assert snapshot.pop(ratio) == pytest.approx(expected.pop(ratio))
    assert snapshot == expected
    snapshot = stats.as_dict()
    assert stats.hit_rate == snapshot["hit_rate"] and stats.padding_ratio == snapshot["padding_ratio"]
    assert 0.0 <= stats.hit_rate <= 1.0 and 0.0 <= stats.padding_ratio < 1.0
    assert (sum(stats.batches_per_budget.values()) + stats.exact_shape_batches
            == stats.graph_replays + stats.no_graph_batches)
    assert sum(stats.fallback_reasons.values()) == stats.eager_batches
    json.dumps(snapshot)  # JSON-ready


# max_examples: the conftest profile (200 dev / 300 ci).
@given(operations, operations)
def test_merge_adds(first, second):
    merged = apply(GraphStats(), first)
    other = apply(GraphStats(), second)
    before = other.as_dict()
    merged.merge(other)
    assert merged.as_dict() == apply(GraphStats(), first + second).as_dict()
    assert other.as_dict() == before, "merge leaves its argument alone"


# max_examples: the conftest profile (200 dev / 300 ci).
@given(operations, operations)
def test_reset_zeros_every_counter(ops, after):
    stats = apply(GraphStats(), ops)
    stats.reset()
    assert stats.as_dict() == GraphStats().as_dict()
    assert stats == GraphStats()
    # and counting starts afresh
    assert apply(stats, after).as_dict() == apply(GraphStats(), after).as_dict()


# max_examples: the conftest profile (200 dev / 300 ci).
@given(budget_configs(max_value=256), item_spec_lists(max_tokens=512))
def test_padding_ratio_matches_the_plans_it_recorded(config, specs):
    """Recording a plan's batches the way the runtime does gives the plan's own padding ratio."""
    plan = plan_batches(specs, config)
    stats = GraphStats()
    stats.record_call()
    for batch in plan.batches:
        if batch.eager:
            stats.record_eager(len(batch.segments), "oversize")
        else:
            stats.record_replay(batch.budget, len(batch.segments), batch.tokens)
    assert stats.padding_ratio == pytest.approx(plan.padding_ratio)
    assert stats.padded_tokens == plan.padded_tokens
    assert stats.real_tokens == plan.real_tokens
    assert stats.graph_items + stats.eager_items == sum(len(b.segments) for b in plan.batches)


def test_fresh_stats_are_zero():
    snapshot = GraphStats().as_dict()
    assert snapshot["hit_rate"] == snapshot["padding_ratio"] == 0.0
    assert all(v == 0 for k, v in snapshot.items() if isinstance(v, int))


UPDATES = {
    "record_replay": lambda s: s.record_replay(64, 2, 60),
    "record_exact": lambda s: s.record_exact(3, graph=False),
    "record_eager": lambda s: s.record_eager(1, "oversize"),
    "record_call": lambda s: s.record_call(),
    "reset": lambda s: s.reset(),
    "merge": lambda s: s.merge(apply(GraphStats(), [("call",)])),
}


@pytest.mark.parametrize("update", sorted(UPDATES))
def test_every_update_waits_for_the_lock(update):
    """Updates serialize on the lock that snapshots take, so a snapshot never sees half an update.

    Under CPython's GIL the lost-update smoke test below rarely loses anything even without the
    lock, so this checks the mechanism directly: while the lock is held, an update cannot finish.
    """
    stats = apply(GraphStats(), [("replay", 64, 1, 32, True), ("call",)])
    before = stats.as_dict()
    done = threading.Event()

    def run() -> None:
        UPDATES[update](stats)
        done.set()

    with stats._lock:
        worker = threading.Thread(target=run)
        worker.start()
        assert not done.wait(0.05), f"{update} finished while the lock was held"
        assert (stats.calls, stats.graph_replays) == (before["calls"], before["graph_replays"])
    worker.join(5)
    assert done.is_set()


def test_concurrent_updates_are_not_lost():
    """Smoke test: threads recording at once lose no update (each update holds the lock)."""
    stats = GraphStats()
    threads, per_thread = 8, 2000
    barrier = threading.Barrier(threads)

    def work(k: int) -> None:
        barrier.wait()
        for _ in range(per_thread):
            stats.record_replay(64, 2, 60)
            stats.record_eager(1, REASONS[k % len(REASONS)])
            stats.record_call()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, to provoke lost updates
    try:
        pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    n = threads * per_thread
    assert (stats.calls, stats.graph_replays, stats.eager_batches) == (n, n, n)
    assert (stats.graph_items, stats.eager_items) == (2 * n, n)
    assert (stats.real_tokens, stats.padded_tokens) == (60 * n, 4 * n)
    assert stats.batches_per_budget == Counter({64: n})
    assert sum(stats.fallback_reasons.values()) == n
