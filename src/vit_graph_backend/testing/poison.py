"""Poisoning graph memory with NaN, for the stress suite (`tests/stress`) and :func:`check_adapter`.

A graph that reads memory nothing wrote in this call (a stale static-buffer tail, a pool
intermediate another graph left) is right only while that memory holds harmless numbers; NaN
written there between calls makes such a read show.

- :func:`poison_static_buffers` fills every static buffer a replay rewrites (floats with NaN,
  integers with ``-1``, bytes with 255); capture-time constants stay.
- :class:`PoolPoisoner` captures one extra graph into the manager's pool that allocates every
  free block (sizes from ``torch.cuda.memory_snapshot()``) and fills it with all-ones bytes (NaN
  in float32, float16 and bfloat16).

Both run under the manager's stream ordering, like a call.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PoolPoisoner", "poison_static_buffers"]


def _fill_nan(t: Any) -> None:
    import torch

    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.uint8:  # a block of bytes under typed views (adapters.staging)
        t.fill_(255)
    elif t.dtype != torch.bool:
        t.fill_(-1)


def poison_static_buffers(manager: Any) -> int:
    """Fill the static buffers every captured budget's replay rewrites; returns how many."""
    count = 0
    with manager.order:
        for entry in list(manager.graphs.entries.values()):
            for key in entry.written:
                _fill_nan(entry.static[key])
                count += 1
            entry.forget_inputs()  # the next replay writes every buffer again
    return count


class PoolPoisoner:
    """A graph in ``manager``'s pool that writes NaN over the pool's free blocks."""

    def __init__(self, manager: Any) -> None:
        import torch

        from ..runtime.capture import capture_lock, capturing
        from ..runtime.launch import capture_stream

        self.manager = manager
        self.graph: Any = None
        pool = manager.graph_pool
        if manager.device.type != "cuda" or pool is None:
            return
        sizes = _free_block_sizes(pool, manager.device)
        if not sizes:
            return
        graph = torch.cuda.CUDAGraph()
        # the graphs' capture stream: free pool blocks go only to the stream that freed them;
        # thread_local: other threads keep running meanwhile
        with manager.order, capture_lock(manager.device), capturing(), torch.cuda.graph(
                graph, pool=pool, stream=capture_stream(manager.device),
                capture_error_mode="thread_local"):
            held = []
            for size in sorted(sizes, reverse=True):
                block = torch.empty(size, dtype=torch.uint8, device=manager.device)
                block.fill_(255)
                held.append(block)
            del held
        self.graph = graph

    def __call__(self) -> None:
        """Write NaN over the pool's free memory, ordered like a call."""
        if self.graph is not None:
            with self.manager.order:
                self.graph.replay()


def _free_block_sizes(pool: Any, device: Any) -> list[int]:
    import torch

    wanted = tuple(pool)
    sizes = []
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device") != device.index or tuple(seg.get("segment_pool_id", ())) != wanted:
            continue
        sizes += [b["size"] for b in seg.get("blocks", ()) if b.get("state") == "inactive"]
    return sizes
