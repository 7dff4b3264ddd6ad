"""Counters for graph hits, eager fallbacks and padding, updated by the runtime, read by users.

One :class:`GraphStats` per runtime. Reads are snapshots (:meth:`GraphStats.as_dict`); updates
take a lock so two threads calling one compiled model count correctly.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GraphStats"]


@dataclass
class GraphStats:
    """Running counts for one runtime.

    Attributes:
        calls: calls served (graph, eager or mixed).
        graph_replays: batches replayed from a graph.
        graph_items: item segments served by a graph replay.
        eager_batches: batches run eagerly (oversize items, no graph, fallbacks).
        eager_items: item segments run eagerly.
        real_tokens: real tokens in replayed batches.
        padded_tokens: padding tokens in replayed batches.
        replays_per_budget: replays counted by budget.
        fallback_reasons: eager runs counted by reason.
    """

    calls: int = 0
    graph_replays: int = 0
    graph_items: int = 0
    eager_batches: int = 0
    eager_items: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    replays_per_budget: Counter[int] = field(default_factory=Counter)
    fallback_reasons: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record_replay(self, budget: int, items: int, real_tokens: int) -> None:
        """Count one graph replay of ``items`` segments holding ``real_tokens`` of ``budget``."""
        with self._lock:
            self.graph_replays += 1
            self.graph_items += items
            self.real_tokens += real_tokens
            self.padded_tokens += budget - real_tokens
            self.replays_per_budget[budget] += 1

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
        """Share of item segments served by graphs (0.0 before any call)."""
        total = self.graph_items + self.eager_items
        return self.graph_items / total if total else 0.0

    @property
    def padding_ratio(self) -> float:
        """Padding as a share of all tokens processed by graphs (0.0 before any replay)."""
        total = self.real_tokens + self.padded_tokens
        return self.padded_tokens / total if total else 0.0

    def merge(self, other: GraphStats) -> None:
        """Add ``other``'s counts into this one (for totals over several runtimes)."""
        snap = other.as_dict()
        with self._lock:
            for name in ("calls", "graph_replays", "graph_items", "eager_batches", "eager_items",
                         "real_tokens", "padded_tokens"):
                setattr(self, name, getattr(self, name) + snap[name])
            self.replays_per_budget.update({int(k): v for k, v in snap["replays_per_budget"].items()})
            self.fallback_reasons.update(snap["fallback_reasons"])

    def reset(self) -> None:
        """Zero every counter."""
        with self._lock:
            self.calls = self.graph_replays = self.graph_items = 0
            self.eager_batches = self.eager_items = self.real_tokens = self.padded_tokens = 0
            self.replays_per_budget.clear()
            self.fallback_reasons.clear()

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready snapshot, with ``hit_rate`` and ``padding_ratio``."""
        with self._lock:
            return {
                "calls": self.calls,
                "graph_replays": self.graph_replays,
                "graph_items": self.graph_items,
                "eager_batches": self.eager_batches,
                "eager_items": self.eager_items,
                "real_tokens": self.real_tokens,
                "padded_tokens": self.padded_tokens,
                "hit_rate": self.hit_rate,
                "padding_ratio": self.padding_ratio,
                "replays_per_budget": {str(k): v for k, v in sorted(self.replays_per_budget.items())},
                "fallback_reasons": dict(self.fallback_reasons),
            }
