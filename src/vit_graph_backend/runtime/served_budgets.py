"""`ServedBudgets`: which budgets a graph manager serves now, and the plans over them.

A budget leaves the served set when its capture is skipped or its replay or verification fails,
with a reason (``memory_report()["disabled_budgets"]``); ``clear()`` brings skipped ones back.
Plans are cached per tuple of item specs and dropped whenever the set changes, so no cached plan
names a budget that is not served.
"""

from __future__ import annotations

import dataclasses

from ..budgets import BudgetConfig
from ..planner import Batch, Plan, eager_reason, plan_batches
from ..specs import EncoderItemSpec

__all__ = ["ServedBudgets"]

#: Distinct calls (tuples of item specs) whose plans are kept; a stream of more starts over.
PLAN_CACHE_SIZE = 1024


class ServedBudgets:
    """The budgets of ``config`` (``VitGraphOptions.resolve``) still served, and cached plans
    over them; ``chunk``: cut row items larger than the largest budget (batched encoders)."""

    def __init__(self, config: BudgetConfig, policy: str, chunk: bool) -> None:
        self.config, self.policy, self.chunk = config, policy, chunk
        #: the config over the served budgets only (``config`` while none is disabled)
        self.active = config
        #: budget -> why it is not served
        self.disabled: dict[int, str] = {}
        self._plans: dict[tuple[EncoderItemSpec, ...], Plan] = {}

    @property
    def budgets(self) -> tuple[int, ...]:
        """The served budgets, ascending."""
        return self.active.budgets

    def plan(self, specs: tuple[EncoderItemSpec, ...]) -> Plan:
        """The plan of one call over the served budgets (cached)."""
        plan = self._plans.get(specs)
        if plan is None:
            plan = plan_batches(specs, self.active, policy=self.policy, chunk=self.chunk)
            if len(self._plans) >= PLAN_CACHE_SIZE:
                self._plans.clear()
            self._plans[specs] = plan
        return plan

    def disable(self, budget: int, reason: str) -> bool:
        """Stop serving ``budget``; ``False`` if no budget is left (then ``active`` keeps the
        last served set, and the caller turns graphs off)."""
        self.disabled[budget] = reason
        return self._serve_remaining()

    def enable(self, budgets: list[int] | tuple[int, ...]) -> bool:
        """Serve ``budgets`` again (memory was freed); ``True`` if any budget is served."""
        for budget in budgets:
            self.disabled.pop(budget, None)
        return self._serve_remaining()

    def clear_plans(self) -> None:
        self._plans.clear()

    def eager_reason(self, batch: Batch) -> str:
        """Why ``batch`` has no budget, naming a disabled budget that would have held it."""
        if batch.tokens > self.active.max_budget:
            skipped = min((b for b in self.disabled if b >= batch.tokens), default=None)
            if skipped is not None:
                return (f"item exceeds the largest captured budget ({self.active.max_budget}); "
                        f"budget {skipped} is not served: {self.disabled[skipped]}")
        return eager_reason(batch, self.active)

    def _serve_remaining(self) -> bool:
        self._plans.clear()
        remaining = tuple(b for b in self.config.budgets if b not in self.disabled)
        if remaining:
            self.active = dataclasses.replace(self.config, budgets=remaining)
        return bool(remaining)
