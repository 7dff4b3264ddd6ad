"""How close each ``vitgraph bench`` mode comes to the device's limit.

- **FLOPs**: PyTorch's :class:`~torch.utils.flop_counter.FlopCounterMode` over one eager pass of
  the stream (the model's useful FLOPs: padding a graph computes shows as a lower fraction).
- **Peak**: the best of several ``n x n x n`` matmuls in the run's dtype, measured in the same run
  (shared machines and drifting clocks make a datasheet figure misleading); none on CPU.
- **Fraction** of a mode: stream FLOPs / the mode's stream seconds / peak.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PEAK_SIDE", "count_stream_flops", "fraction_of_peak", "matmul_peak_tflops"]

#: Side of the square matmul that measures the peak (large enough to saturate an H100).
PEAK_SIDE = 8192


def count_stream_flops(fn: Callable[..., Any], inputs: Sequence[tuple[Any, ...]]) -> int:
    """FLOPs of ``fn`` over every call of the stream, counted by ``FlopCounterMode``."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        for args in inputs:
            fn(*args)
    return int(counter.get_total_flops())


def matmul_peak_tflops(device: str, dtype: Any, *, side: int = PEAK_SIDE,
                       repeats: int = 20) -> float | None:
    """The best TFLOP/s of a ``side``-cubed matmul on ``device`` in ``dtype`` (CUDA events,
    after warm-up), or ``None`` off CUDA."""
    import torch

    if not str(device).startswith("cuda"):
        return None
    a = torch.randn(side, side, device=device, dtype=dtype)
    b = torch.randn(side, side, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * side ** 3 / best / 1e12


def fraction_of_peak(stream_flops: int, stream_seconds: float | None,
                     peak_tflops: float | None) -> tuple[float | None, float | None]:
    """``(achieved TFLOP/s, fraction of peak)`` of a mode; ``None`` where a term is missing."""
    if not stream_seconds or not stream_flops:
        return None, None
    achieved = stream_flops / stream_seconds / 1e12
    return achieved, (achieved / peak_tflops if peak_tflops else None)
