"""What AOTAutograd's and Inductor's compile caches did while a block ran (hits, misses,
bypasses), for the tests that check a rewritten graph is still cached."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from vit_graph_backend import _compat


@contextmanager
def cache_outcomes() -> Iterator[dict[str, int]]:
    """Yields a dict that, once the block ends, holds each cache count the block changed."""
    before = _compat.compile_cache_counts()
    changed: dict[str, int] = {}
    yield changed
    after = _compat.compile_cache_counts()
    changed.update({k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)})
