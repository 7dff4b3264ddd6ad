"""Counters for graph hits, eager fallbacks and padding, updated by the runtime, read by users.

One :class:`GraphStats` per runtime; updates take a lock so threads sharing a model count
correctly. The counters say what really ran: a batch is a *graph replay* only when a captured
graph replayed it; without CUDA batches count in ``no_graph_batches``.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GraphStats"]

_COUNTS = ("calls", "graph_replays", "graph_items", "no_graph_batches", "no_graph_items",
           "eager_batches", "eager_items", "exact_shape_batches", "real_tokens", "padded_tokens")


@dataclass
class GraphStats:
    """Running counts for one runtime.

    Attributes:
        calls: calls served (graph, eager or mixed).
        graph_replays: batches replayed from a captured CUDA graph.
        graph_items: item segments served by those replays.
        no_graph_batches: batches run without a graph (no CUDA device).
        no_graph_items: item segments served by those batches.
        eager_batches: batches run eagerly, unpadded (oversize items, fallbacks).
        eager_items: item segments run eagerly.
        exact_shape_batches: batches of an exact-shape graph (no budget, no padding).
        real_tokens: real tokens (rows) in graph and no-graph batches.
        padded_tokens: padding tokens in graph and no-graph batches.
        batches_per_budget: graph and no-graph batches counted by token budget.
        fallback_reasons: eager batches counted by reason."""

    calls: int = 0
    graph_replays: int = 0
    graph_items: int = 0
    no_graph_batches: int = 0
    no_graph_items: int = 0
    eager_batches: int = 0
    eager_items: int = 0
    exact_shape_batches: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    batches_per_budget: Counter[int] = field(default_factory=Counter)
    fallback_reasons: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record_replay(self, budget: int, items: int, real_tokens: int, *,
                      graph: bool = True) -> None:
        """Count one padded batch of ``items`` segments, ``real_tokens`` of ``budget`` (``graph``:
        replayed from a CUDA graph)."""
        with self._lock:
            self._count_run(items, graph)
            self.real_tokens += real_tokens
            self.padded_tokens += budget - real_tokens
            self.batches_per_budget[budget] += 1

    def record_unpadded(self, items: int, real_tokens: int) -> None:
        """Count one batch of ``items`` segments run at its own size without a graph."""
        with self._lock:
            self._count_run(items, False)
            self.real_tokens += real_tokens

    def record_exact(self, rows: int, *, graph: bool = True) -> None:
        """Count one call of an exact-shape graph holding ``rows`` real rows."""
        with self._lock:
            self._count_run(1, graph)
            self.exact_shape_batches += 1
            self.real_tokens += rows

    def _count_run(self, items: int, graph: bool) -> None:
        if graph:
            self.graph_replays += 1
            self.graph_items += items
        else:
            self.no_graph_batches += 1
            self.no_graph_items += items

    def record_eager(self, items: int, reason: str) -> None:
        """Count one eager batch of ``items`` segments, run because of ``reason``."""
        with self._lock:
            self.eager_batches += 1
            self.eager_items += items
            self.fallback_reasons[reason] += 1

    def record_call(self) -> None:
        """Count one call."""
        with self._lock:
            self.calls += 1

    @property
    def hit_rate(self) -> float:
        """Share of item segments served by CUDA graph replays (0.0 before any call)."""
        total = self.graph_items + self.no_graph_items + self.eager_items
        return self.graph_items / total if total else 0.0

    @property
    def padding_ratio(self) -> float:
        """Padding as a share of all tokens of padded batches (0.0 before any)."""
        total = self.real_tokens + self.padded_tokens
        return self.padded_tokens / total if total else 0.0

    def merge(self, other: GraphStats) -> None:
        """Add ``other``'s counts into this one (for totals over several runtimes)."""
        snap = other.as_dict()
        with self._lock:
            for name in _COUNTS:
                setattr(self, name, getattr(self, name) + snap[name])
            self.batches_per_budget.update(
                {int(k): v for k, v in snap["batches_per_budget"].items()})
            self.fallback_reasons.update(snap["fallback_reasons"])

    def reset(self) -> None:
        """Zero every counter."""
        with self._lock:
            for name in _COUNTS:
                setattr(self, name, 0)
            self.batches_per_budget.clear()
            self.fallback_reasons.clear()

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready snapshot, with ``hit_rate`` and ``padding_ratio``."""
        with self._lock:
            snap: dict[str, Any] = {name: getattr(self, name) for name in _COUNTS}
            snap.update(
                hit_rate=self.hit_rate,
                padding_ratio=self.padding_ratio,
                batches_per_budget={str(k): v for k, v in sorted(self.batches_per_budget.items())},
                fallback_reasons=dict(self.fallback_reasons),
            )
            return snap
