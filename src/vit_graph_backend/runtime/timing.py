"""The GPU time of a short piece of work as a CUDA graph runs it: how the package's choices
between kernels are timed (``fused_linear`` per GEMM shape, ``adapters/_attention_choice.py``
per budget).

A single launch timed with CUDA events measures the host's launch time wherever the kernels are
short: on an H100 a small budget's window attention timed that way took 0.07 to 0.15 ms against 4
to 12 us of GPU time (``benchmarks/results/window_attention_*``), so such a timing picks whichever
candidate launches fewer kernels, not the one the graph runs faster. :func:`graph_ms` captures a
few calls into a temporary graph and times its replays instead.

It captures with ``CUDAGraph.capture_begin``/``capture_end`` on a side stream rather than through
``torch.cuda.graph``, whose entry synchronizes the device and empties the allocator's device and
pinned-host caches (and runs ``gc.collect()`` where ``torch.compiler.config.force_cudagraph_gc``
is set; off by default in torch 2.11): paid for every candidate of every shape, that would land
in a model's first pass, and emptied caches make the next allocations slow.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from .. import _compat
from ..errors import error_line, out_of_memory

__all__ = ["LONG_REPLAY_MS", "LONG_REPS", "graph_ms", "time_each", "timings_short_of_memory"]

_T = TypeVar("_T")


#: One side stream per device for every timing, created on first use: cuBLAS keeps a workspace
#: (tens of MiB on Hopper) for each stream it has run on, for the process's life, so a fresh pool
#: stream per timing grew a ViT-B/16 stream's peak memory by 363 MiB over its 18 budgets.
#: With each stream, one element of that device, written inside a timing capture whose work raised
#: before it launched anything (out of memory at its first allocation, say): PyTorch warns of an
#: empty graph at the capture's end as one "captured on wrong device or stream", which would send
#: whoever reads the log after a timing that only ran out of memory looking for the wrong fault.
_streams: dict[int, tuple[torch.cuda.Stream, torch.Tensor]] = {}
#: One timing at a time: a stream can hold only one capture. Re-entrant, for an ``fn`` whose
#: first run (outside the capture) times something itself.
_lock = threading.RLock()
#: A timing graph whose untimed first replay takes at least this long is timed over at most
#: :data:`LONG_REPS` replays: at that length the event timer's microseconds and the launch are
#: lost in the work, and the replays the default ``reps`` adds cost the first pass GPU time (in
#: the Qwen2.5-VL-3B tower's capture, its large budgets' attention races: 0.1 to 0.2 s of about
#: 3 s on an H100, ``benchmarks/results/first_pass_one_warm_up_run_*``).
LONG_REPLAY_MS = 2.0
LONG_REPS = 2


def graph_ms(fn: Callable[[], Any], calls: int = 5, reps: int = 5) -> float:
    """GPU ms per call of ``fn``, replayed from a CUDA graph of ``calls`` calls: the median of
    ``reps`` replays after an untimed one, or of at most :data:`LONG_REPS` where that one took
    :data:`LONG_REPLAY_MS` or more.

    ``fn`` runs once outside the capture first (a Triton compile, lazy modules). It runs on the
    current device's timing stream, which waits for the caller's stream, and the caller's stream
    waits for it in turn, so ``fn`` may read tensors the caller just wrote. The caller makes the
    device of ``fn``'s tensors current: on another device's stream their kernels would run
    outside the capture. The capture is thread-local: another thread's work stays legal
    meanwhile. Raises what ``fn`` raises, with the capture closed.
    """
    caller = torch.cuda.current_stream()
    with _lock:
        if caller.device.index not in _streams:
            _streams[caller.device.index] = (torch.cuda.Stream(device=caller.device),
                                             torch.zeros(1, device=caller.device))
        side, mark = _streams[caller.device.index]
        side.wait_stream(caller)
        try:
            with torch.cuda.stream(side):
                fn()
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    for _ in range(calls):
                        fn()
                except BaseException:
                    _write_in_capture(mark)
                    try:
                        graph.capture_end()
                    except RuntimeError:  # invalidated: close the allocator's side too
                        _compat.end_failed_capture(graph.pool(), caller.device)
                    raise
                graph.capture_end()
                if _replay_ms(graph, side) >= LONG_REPLAY_MS:
                    reps = min(reps, LONG_REPS)
                times = [_replay_ms(graph, side) / calls for _ in range(max(1, reps))]
        finally:
            caller.wait_stream(side)
    return statistics.median(times)


def time_each(candidates: Iterable[_T], run: Callable[[_T], Any], *, calls: int, reps: int,
              timer: Callable[..., float] = graph_ms
              ) -> tuple[dict[_T, float], dict[_T, tuple[str, bool]]]:
    """Each candidate's GPU ms per ``run(candidate)`` (``timer``: :func:`graph_ms`, or what a
    caller's tests put in its place), and for each that raised instead, the reason in one line
    and whether it said memory ran out (``errors.out_of_memory``: the moment's memory, not the
    candidate, so the caller may try it again later rather than refuse it). The per-shape
    choices of ``fused_linear`` and ``attention_op`` are timed with it."""
    times: dict[_T, float] = {}
    failures: dict[_T, tuple[str, bool]] = {}
    for candidate in candidates:
        try:
            times[candidate] = timer(lambda candidate=candidate: run(candidate), calls=calls,
                                     reps=reps)
        except Exception as exc:  # a kernel this GPU or Triton cannot build, or memory
            failures[candidate] = (error_line(exc), out_of_memory(exc))
    short = sum(memory for _, memory in failures.values())
    if short:
        with _SHORT_LOCK:
            _SHORT[0] += short
    return times, failures


_SHORT = [0]
_SHORT_LOCK = threading.Lock()


def timings_short_of_memory() -> int:
    """Kernel timings of this process that memory cut short (``report()["out_of_memory"]``)."""
    with _SHORT_LOCK:
        return _SHORT[0]


def _write_in_capture(mark: torch.Tensor) -> None:
    """One kernel into a capture that is being abandoned, so that it never ends empty."""
    try:
        mark.zero_()
    except Exception:  # an invalidated capture: its end raises next, and says why
        pass


def _replay_ms(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> float:
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record(stream)
    graph.replay()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)
