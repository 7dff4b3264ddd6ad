"""`ServedBudgets`: the manager's book of served budgets and cached plans (``served_budgets.py``).

Expected budgets and batches are written out by hand from the baseline policy (the smallest
budget that holds a batch), not taken from the planner.
"""

from __future__ import annotations

from vit_graph_backend.budgets import BudgetConfig
from vit_graph_backend.runtime.served_budgets import PLAN_CACHE_SIZE, ServedBudgets
from vit_graph_backend.specs import EncoderItemSpec


def _specs(*tokens: int) -> tuple[EncoderItemSpec, ...]:
    return tuple(EncoderItemSpec(t, t) for t in tokens)


def _book() -> ServedBudgets:
    return ServedBudgets(BudgetConfig((16, 32, 64), 1), "baseline", chunk=False)


def test_a_disabled_budget_leaves_every_later_plan_and_comes_back_when_enabled():
    book = _book()
    assert [b.budget for b in book.plan(_specs(20)).batches] == [32]
    assert book.disable(32, "verification failed: 0.5 > 0.03") is True
    assert book.budgets == (16, 64) and book.disabled == {32: "verification failed: 0.5 > 0.03"}
    # the cached plan for this call named 32: it must not be served again
    assert [b.budget for b in book.plan(_specs(20)).batches] == [64]
    assert book.enable([32]) is True
    assert book.budgets == (16, 32, 64) and book.disabled == {}
    assert [b.budget for b in book.plan(_specs(20)).batches] == [32]


def test_disabling_the_last_budget_reports_none_left_and_keeps_the_last_set():
    book = _book()
    assert book.disable(16, "out of memory") and book.disable(64, "out of memory")
    assert book.disable(32, "capture failed") is False
    assert book.budgets == (32,)  # the caller turns graphs off; the set is not emptied


def test_eager_reason_names_the_disabled_budget_that_would_have_held_the_item():
    book = _book()
    book.disable(64, "out of memory at capture")
    (batch,) = book.plan(_specs(50)).batches
    assert batch.budget is None
    reason = book.eager_reason(batch)
    assert reason == ("item exceeds the largest captured budget (32); budget 64 is not served: "
                      "out of memory at capture")


def test_the_plan_cache_starts_over_past_its_size():
    book = _book()
    first = book.plan(_specs(1))
    assert book.plan(_specs(1)) is first  # cached: the same object
    for n in range(2, PLAN_CACHE_SIZE + 2):
        book.plan(_specs(n % 60 + 1, n))
    assert book.plan(_specs(1)) is not first  # dropped with the rest, planned again
