"""Host time of a small check per call, for the probes of this folder that time one: three runs of
``number`` calls each (``timeit``), in microseconds a call."""

from __future__ import annotations

import timeit
from collections.abc import Callable


def per_call_us(fn: Callable[[], object], number: int) -> list[float]:
    """Microseconds a call of ``fn``, in each of three runs of ``number`` calls."""
    return [timeit.timeit(fn, number=number) / number * 1e6 for _ in range(3)]


def timed_rows(checks: dict[str, Callable[[], object]], number: int, width: int,
               digits: int) -> list[str]:
    """A row a check: its name padded to ``width``, then its three runs' microseconds a call."""
    return [f"{name:<{width}}" + " / ".join(f"{us:.{digits}f}" for us in per_call_us(fn, number))
            for name, fn in checks.items()]
