"""One report of what a set of graph managers did: the fields ``report()`` returns.

``vit_graph_backend.report()``, the backend's ``vitgraph.report()`` and
``PackedGraphEncoder.report()`` all build their answer here, from the managers' public surface, so
they agree field by field. Without CUDA, graph counts and memory are 0 and batches count as
``no_graph_batches``; exact-shape graphs count in ``exact_shape_graphs``, never as a budget.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .timing import timings_short_of_memory
from ..stats import GraphStats

__all__ = ["REPORT_FIELDS", "summarize"]

#: The keys of :func:`summarize`'s answer, documented in the README's ``report()`` section.
REPORT_FIELDS = ("cuda_graphs", "graphs_captured", "exact_shape_graphs", "device_launch_graphs",
                 "captured_budgets", "skipped_budgets", "out_of_memory", "graph_memory_bytes",
                 "static_input_bytes", "capture_seconds", "preparing", "prepare_seconds", "stats")


def summarize(managers: Iterable[Any], extra_stats: Iterable[GraphStats] = ()) -> dict[str, Any]:
    """Totals over ``managers`` plus counts kept outside them (calls refused before a manager)."""
    stats = GraphStats()
    for extra in extra_stats:
        stats.merge(extra)
    graphs = exact = device_launch = memory = static = oom = 0
    seconds = 0.0
    preparing, prepared = 0, []
    budgets: set[int] = set()
    skipped: dict[str, str] = {}
    cuda_graphs = False
    for manager in managers:
        stats.merge(manager.stats)
        report = manager.memory_report()
        cuda_graphs = cuda_graphs or bool(manager.uses_cuda_graphs)
        memory += report["total_bytes"]
        static += report["static_input_bytes"]
        seconds += report["capture_seconds"]
        oom += report["out_of_memory_skips"]
        preparing += bool(report["preparing"])
        if report["prepare_seconds"] is not None:
            prepared.append(report["prepare_seconds"])
        device_launch += sum(kind == "device" for kind in report["graph_launch"].values())
        if manager.exact_rows is not None:
            exact += report["graphs"]
            continue
        graphs += report["graphs"]
        budgets.update(report["captured_budgets"])
        for budget, reason in report["skipped_budgets"].items():
            skipped.setdefault(str(budget), reason)
    return {
        "cuda_graphs": cuda_graphs,
        "graphs_captured": graphs + exact,
        "exact_shape_graphs": exact,
        "device_launch_graphs": device_launch,
        "captured_budgets": sorted(budgets),
        "skipped_budgets": skipped,
        # kernel timings cut short are counted process-wide
        "out_of_memory": {"skipped_budgets": oom, "kernel_timings": timings_short_of_memory()},
        "graph_memory_bytes": memory,
        "static_input_bytes": static,
        "capture_seconds": round(seconds, 4),
        # capture="background": preparations still running, the longest one that finished
        "preparing": preparing,
        "prepare_seconds": round(max(prepared), 4) if prepared else None,
        "stats": stats.as_dict(),
    }
