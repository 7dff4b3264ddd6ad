"""Plan preview: what the ``vitgraph`` planner does with a call or a stream, without torch.

``vitgraph plan`` and ``vitgraph bench``'s routing section come from here, counted with
:class:`~vit_graph_backend.stats.GraphStats` as in the runtime, so a preview agrees with what the
backend replays and reports. No torch import: ``vitgraph plan`` is instant on any machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .budgets import BudgetConfig
from .planner import Plan, eager_reason, plan_batches
from .specs import EncoderItemSpec
from .stats import GraphStats

__all__ = ["eager_summary", "format_plan", "plan_line", "plan_stream", "plan_to_dict",
           "summarize_plans"]


def summarize_plans(plans: Sequence[Plan], config: BudgetConfig) -> dict[str, Any]:
    """Totals over a stream's plans, keyed as :meth:`GraphStats.as_dict` (planned, not measured)."""
    stats = GraphStats()
    for plan in plans:
        stats.record_call()
        for batch in plan.batches:
            if batch.eager:
                stats.record_eager(len(batch.segments), eager_reason(batch, config))
            else:
                stats.record_replay(batch.budget, len(batch.segments), batch.tokens)
    return stats.as_dict()


def plan_to_dict(plan: Plan, specs: Sequence[EncoderItemSpec]) -> dict[str, Any]:
    """A JSON-ready description of one call's plan."""
    return {
        "items": [{"input_size": s.input_size, "output_tokens": s.output_tokens,
                   "frames": s.frames} for s in specs],
        "batches": [{"budget": b.budget, "items": list(b.items), "tokens": b.tokens,
                     "padded_tokens": b.padded_tokens} for b in plan.batches],
        "eager_items": list(plan.eager_items),
        "real_tokens": plan.real_tokens,
        "padded_tokens": plan.padded_tokens,
        "padding_ratio": plan.padding_ratio,
    }


def format_plan(plan: dict[str, Any], *, unit: str = "tokens", indent: str = "") -> list[str]:
    """Text lines for a plan given as :func:`plan_to_dict` returns it."""
    rows = [("batch", "budget", "items", unit, "padding")]
    for i, batch in enumerate(plan["batches"]):
        eager = batch["budget"] is None
        rows.append((str(i), "eager" if eager else str(batch["budget"]),
                     ",".join(map(str, batch["items"])), str(batch["tokens"]),
                     "-" if eager else str(batch["padded_tokens"])))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].rjust(widths[0]), row[1].rjust(widths[1]), row[2].ljust(widths[2]),
                 row[3].rjust(widths[3]), row[4].rjust(widths[4])]
        lines.append(indent + "  ".join(cells).rstrip())
    total = plan["real_tokens"] + plan["padded_tokens"]
    lines.append(
        f"{indent}padding waste: {plan['padded_tokens']} of {total} graph {unit} "
        f"({100.0 * plan['padding_ratio']:.1f} %); eager: {eager_summary(plan['eager_items'])}")
    return lines


def eager_summary(items: Sequence[int]) -> str:
    """``"none"``, or the count and the indices, marked as indices: ``"2 items (#0, #3)"``."""
    if not items:
        return "none"
    return f"{len(items)} item{'s' if len(items) > 1 else ''} ({', '.join(f'#{i}' for i in items)})"


def plan_line(plan: dict[str, Any], *, unit: str = "tokens") -> str:
    """One line for a plan given as :func:`plan_to_dict` returns it (the bench's sample calls)."""
    parts = []
    for batch in plan["batches"]:
        items = ",".join(map(str, batch["items"]))
        if batch["budget"] is None:
            parts.append(f"[eager: items {items}, {batch['tokens']}]")
        else:
            parts.append(f"[budget {batch['budget']}: items {items}, {batch['tokens']} + "
                         f"{batch['padded_tokens']} padding]")
    sizes = ",".join(str(item["output_tokens"]) for item in plan["items"])
    return f"items of {sizes} {unit} -> {' '.join(parts)}"


def plan_stream(calls_specs: Sequence[Sequence[EncoderItemSpec]], config: BudgetConfig, *,
                policy: str = "baseline", chunk: bool = False) -> list[Plan]:
    """Plan every call of a stream."""
    return [plan_batches(specs, config, policy=policy, chunk=chunk) for specs in calls_specs]
