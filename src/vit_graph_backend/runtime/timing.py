"""The GPU time of a short piece of work as a CUDA graph runs it: how kernel choices are timed
(``fused_linear`` per GEMM shape, attention choices per budget).

A single launch timed with CUDA events measures host launch time wherever kernels are short, so
it picks whichever candidate launches fewer kernels. :func:`graph_ms` captures a few calls into a
temporary graph and times its replays instead, with ``capture_begin``/``capture_end`` on a side
stream: ``torch.cuda.graph``'s entry synchronizes the device and empties the allocator's caches,
which would land in a model's first pass for every candidate.
"""

from __future__ import annotations

import functools
import hashlib
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..cache_dir import installed_version, keeping
from ..errors import error_line, out_of_memory
from .capture import capture_broken, capture_lock, capturing, close_failed_capture
from .launch import device_index

__all__ = ["LONG_REPLAY_MS", "LONG_REPS", "choice_key", "graph_ms", "kernel_timing_seconds",
           "time_each", "timings_short_of_memory"]

_T = TypeVar("_T")


#: One side stream per device for every timing (cuBLAS keeps a workspace per stream it ran on,
#: for the process's life), with one element written into an abandoned capture so it never ends
#: empty (PyTorch would warn of a wrong device or stream).
_streams: dict[int, tuple[torch.cuda.Stream, torch.Tensor]] = {}
#: One timing at a time (one capture per stream); re-entrant for an ``fn`` that times itself.
_lock = threading.RLock()
#: A timing graph whose untimed first replay takes at least this long is timed over at most
#: :data:`LONG_REPS` replays: launch noise is lost in the work, and more replays only lengthen
#: the first pass.
LONG_REPLAY_MS = 2.0
LONG_REPS = 2


def graph_ms(fn: Callable[[], Any], calls: int = 5, reps: int = 5) -> float:
    """GPU ms per call of ``fn``, replayed from a CUDA graph of ``calls`` calls: the median of
    ``reps`` replays after an untimed one, or of at most :data:`LONG_REPS` where that one took
    :data:`LONG_REPLAY_MS` or more.

    ``fn`` runs once outside the capture first (compiles, lazy set-up), on the current device's
    timing stream, ordered both ways with the caller's stream. The caller makes ``fn``'s device
    current. Raises what ``fn`` raises, with the capture closed.
    """
    caller = torch.cuda.current_stream()
    # its capture is one capture of the device: never beside a budget's (capture.capture_lock)
    with capture_lock(caller.device), _lock:
        start = time.perf_counter()   # not the wait for another thread's timing
        _TIMED[1] += 1
        if caller.device.index not in _streams:
            _streams[caller.device.index] = (torch.cuda.Stream(device=caller.device),
                                             torch.zeros(1, device=caller.device))
        side, mark = _streams[caller.device.index]
        side.wait_stream(caller)
        try:
            with torch.cuda.stream(side):
                fn()
                graph = torch.cuda.CUDAGraph()
                with capturing():
                    graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        for _ in range(calls):
                            fn()
                    except BaseException:
                        _write_in_capture(mark)
                        _end_capture(graph, caller.device, raising=False)
                        raise
                    _end_capture(graph, caller.device, raising=True)
                if _replay_ms(graph, side) >= LONG_REPLAY_MS:
                    reps = min(reps, LONG_REPS)
                times = [_replay_ms(graph, side) / calls for _ in range(max(1, reps))]
        finally:
            caller.wait_stream(side)
            _TIMED[1] -= 1
            if not _TIMED[1]:   # a timing inside a timed fn is in the outer one's time
                _TIMED[0] += time.perf_counter() - start
    return statistics.median(times)


def _end_capture(graph: torch.cuda.CUDAGraph, device: torch.device, raising: bool) -> None:
    """End a timing's capture; one invalidated meanwhile (``capture_end`` raises) is closed
    (``capture.close_failed_capture``), then raises if ``raising`` (else the error being handled
    goes on)."""
    try:
        graph.capture_end()
    except RuntimeError:
        close_failed_capture(graph.pool(), device)
        if raising:
            raise


#: Seconds this process spent timing kernel candidates, and the depth of timings under way
#: (both under :data:`_lock`).
_TIMED: list[float] = [0.0, 0]


def kernel_timing_seconds() -> float:
    """Seconds this process spent in :func:`graph_ms` so far: its kernel choices (the first
    pass's "kernel choices" phase in ``vitgraph bench``)."""
    with _lock:
        return _TIMED[0]


def choice_key(what: str, device: torch.device, *shape: Any) -> str | None:
    """The key a kernel choice is kept under across processes (``cache_dir.keep_choice``): what
    was chosen and for which shape, on which GPU model, under which torch, Triton and cuDNN
    releases and which code of this package (a digest of its sources: an edit times the kernels
    again). ``None`` where no folder keeps choices (``use_cache_dir`` not called)."""
    if not keeping():
        return None
    device = torch.device(device)
    if device.type == "cuda":
        index = device_index(device)
        major, minor = torch.cuda.get_device_capability(index)
        where = f"{torch.cuda.get_device_name(index)} sm{major}{minor}"
    else:
        where = device.type
    return "|".join(map(str, (what, *shape, where, *_releases())))


@functools.cache
def _releases() -> tuple[str, ...]:
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        digest.update(source.read_bytes())
    return (f"torch {torch.__version__}", f"triton {installed_version('triton')}",
            f"cudnn {torch.backends.cudnn.version()}",
            f"cudnn-frontend {installed_version('nvidia-cudnn-frontend')}",
            f"code {digest.hexdigest()[:16]}")


def time_each(candidates: Iterable[_T], run: Callable[[_T], Any], *, calls: int, reps: int,
              timer: Callable[..., float] = graph_ms
              ) -> tuple[dict[_T, float], dict[_T, tuple[str, bool]]]:
    """Each candidate's GPU ms per ``run(candidate)`` (``timer``: :func:`graph_ms` or a test
    stand-in), and for each that raised, the reason in one line and whether the failure was the
    moment's (memory ran out, or CUDA broke the timing's capture from outside), so that the
    caller may try it again later rather than refuse it."""
    times: dict[_T, float] = {}
    failures: dict[_T, tuple[str, bool]] = {}
    short = 0
    for candidate in candidates:
        try:
            times[candidate] = timer(lambda candidate=candidate: run(candidate), calls=calls,
                                     reps=reps)
        except Exception as exc:  # a kernel this GPU or Triton cannot build, or memory
            memory = out_of_memory(exc)
            short += memory
            # a timing capture broken from outside (a device-wide synchronize in another
            # thread) is, like memory, the moment's: tried again later, never refused
            failures[candidate] = (error_line(exc), memory or capture_broken(str(exc)))
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
