"""Per-call timing, latency summaries and progress bars for ``vitgraph bench``.

On CUDA a call is timed with CUDA events after a ``synchronize()``, waiting on the end event, so
the time covers that call's launches and device work only; on CPU, ``time.perf_counter``.
Percentiles interpolate linearly (NumPy's default), written out to need only the standard library.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

__all__ = ["CallTimer", "percentile", "progress", "summarize"]

T = TypeVar("T")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` with linear interpolation between ranks.

    Raises:
        ValueError: for no values or ``q`` outside ``[0, 100]``.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q={q} is invalid: must be within [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(ms: Sequence[float]) -> dict[str, float]:
    """p50, p99, mean, min and max of per-call milliseconds."""
    return {"p50": percentile(ms, 50.0), "p99": percentile(ms, 99.0), "mean": sum(ms) / len(ms),
            "min": min(ms), "max": max(ms)}


class CallTimer:
    """Times calls on one device: CUDA events on a CUDA device, ``perf_counter`` elsewhere."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        """Wait for the work of the calls (a no-op on CPU): the current stream's, where every
        call's work ends. Not the whole device: that would wait for, and invalidate, a capture
        another thread runs (``capture="background"``)."""
        if self.cuda:
            self._torch.cuda.current_stream(self.device).synchronize()

    def time_call(self, fn: Callable[..., Any], args: Sequence[Any]) -> tuple[Any, float]:
        """Run ``fn(*args)`` once; return its output and the milliseconds it took."""
        if not self.cuda:
            start = time.perf_counter()
            out = fn(*args)
            return out, (time.perf_counter() - start) * 1e3
        self.sync()
        start_event = self._torch.cuda.Event(enable_timing=True)
        end_event = self._torch.cuda.Event(enable_timing=True)
        start_event.record()
        out = fn(*args)
        end_event.record()
        end_event.synchronize()
        return out, start_event.elapsed_time(end_event)

    def wall(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """Run ``fn()`` between two syncs; return its result and the wall seconds it took."""
        self.sync()
        start = time.perf_counter()
        result = fn()
        self.sync()
        return result, time.perf_counter() - start

    def host(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """Run ``fn()`` with the device idle at its start; return its result and the seconds
        until it returned (its host time, when it never waits for the device), then wait for the
        device."""
        self.sync()
        start = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - start
        self.sync()
        return result, seconds


def progress(iterable: Iterable[T], *, desc: str, total: int | None = None,
             enabled: bool = True) -> Iterator[T]:
    """``tqdm`` over ``iterable`` when tqdm is installed and ``enabled``; plain iteration otherwise.

    The bar goes to stderr and leaves no line behind; while it is up, logging goes through
    ``tqdm.write`` so a warning gets its own line.
    """
    if enabled:
        try:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm
        except ImportError:
            pass
        else:
            with logging_redirect_tqdm():
                yield from tqdm(iterable, desc=desc, total=total, leave=False, unit="call")
            return
    yield from iterable
