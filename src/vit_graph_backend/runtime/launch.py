"""How a captured graph is launched: an executable made for device launch, or PyTorch's own.

``CUDAGraph.replay()`` launches the executable PyTorch instantiated with no flags. That launch costs
the host about 5 to 50 µs for a graph of kernels only, but once the graph holds memset nodes it
grows by about 1.5 µs per memset: cuBLAS puts a 4-byte memset before each GEMM whose kernel needs
a zeroed counter in its workspace, which on an H100 it does for the larger row counts, so the
Qwen2.5-VL-3B tower's graphs of 768 tokens and more (36 to 166 memsets, by kernel settings) took
0.2 to 0.6 ms of host time per launch, and 300 GEMMs of 16,384 rows 0.53 ms. The same graphs
instantiated with the driver's ``CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH`` launch from the host
in 0.02 to 0.13 ms (the tower) and 0.02 to 0.05 ms (the GEMMs), and their GPU work takes as long
(``benchmarks/graph_launch_probe.py``; ``benchmarks/results/graph_launch_*``).

:func:`make_launcher` takes a graph captured with ``keep_graph=True`` and returns what the runtime
replays:

- a :class:`DeviceLaunchGraph`: the graph instantiated by the CUDA driver (through ``ctypes``, the
  only driver entry points this package uses) for device launch, uploaded once, launched with
  ``cuGraphLaunch`` into the caller's current stream. The ``torch.cuda.CUDAGraph`` stays alive
  beside it: it owns the captured graph and its memory pool.
- the ``torch.cuda.CUDAGraph`` itself, instantiated by PyTorch, when ``graph_launch="torch"``, when
  the forward draws random numbers (PyTorch's replay advances the generator's offsets per launch;
  a launch outside it would repeat the same numbers; the check reads the device's default
  generator in the warm-up, so a forward drawing from a CUDA generator of its own should set
  ``graph_launch="torch"``), when the driver library cannot be loaded,
  or when the driver refuses device launch for this graph (it allows kernel, memcpy and memset
  nodes on one device only). The reason is logged once.

A launch that fails raises ``RuntimeError`` with the driver's error code: the runtime then runs the
batch eagerly and disables that budget, like any failed replay.

:func:`capture_stream` is the stream a device's graphs are captured on (``graph_capture.py``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import weakref
from typing import Any

import torch

from .._compat import current_raw_stream

__all__ = ["DeviceLaunchGraph", "capture_stream", "device_index", "launch_kind", "make_launcher"]

log = logging.getLogger(__name__)

_DEVICE_LAUNCH = 4  # CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: the launching thread has no current context
_logged: set[str] = set()
_logged_lock = threading.Lock()


@functools.cache
def _driver() -> Any:
    """The CUDA driver library (``libcuda``), or the ``OSError`` that loading it raised."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        for name, args in (("cuGraphInstantiateWithFlags",
                            (ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                             ctypes.c_ulonglong)),
                           ("cuGraphUpload", (ctypes.c_void_p, ctypes.c_void_p)),
                           ("cuGraphLaunch", (ctypes.c_void_p, ctypes.c_void_p)),
                           ("cuGraphExecDestroy", (ctypes.c_void_p,))):
            fn = getattr(cu, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        return cu
    except (OSError, AttributeError) as exc:
        return exc


def device_index(device: torch.device) -> int:
    """``device``'s index; the current device's for a bare ``"cuda"``."""
    return device.index if device.index is not None else torch.cuda.current_device()


_capture_streams: dict[int, torch.cuda.Stream] = {}
_capture_streams_lock = threading.Lock()


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream every graph of ``device`` is captured on: the allocator hands a pool's free
    blocks only to allocations on the stream that freed them, so a stream per capture would stop
    the smaller graphs reusing the larger ones' memory. One per device, not ``torch.cuda.graph``'s
    default, which is one stream for the process made on whichever device was current when it was
    first used: a capture for another GPU's tensors then begins on the first GPU (the forward's
    kernels run eagerly outside it and the graph is empty, or the capture fails and leaves that
    GPU's random-number generator in capture mode, so every later draw there raises:
    ``benchmarks/results/gpu_suite_two_gpus_capture_stream_on_the_first_gpu_*``)."""
    index = device_index(device)
    with _capture_streams_lock:
        stream = _capture_streams.get(index)
        if stream is None:
            stream = _capture_streams[index] = torch.cuda.Stream(device=index)
        return stream


def _log_once(reason: str) -> None:
    with _logged_lock:
        if reason in _logged:
            return
        _logged.add(reason)
    log.info("vitgraph: graphs launch through CUDAGraph.replay(): %s", reason)


def _destroy(cu: Any, handle: int) -> None:
    cu.cuGraphExecDestroy(ctypes.c_void_p(handle))  # at interpreter exit the driver may be gone


class DeviceLaunchGraph:
    """A captured graph's executable instantiated by the driver for device launch.

    Args:
        graph: the ``torch.cuda.CUDAGraph`` (captured with ``keep_graph=True``, not instantiated
            by PyTorch) whose graph this executes; kept alive with its memory pool.
        handle: the ``CUgraphExec``.
        device: the graph's CUDA device.
    """

    kind = "device"

    def __init__(self, graph: torch.cuda.CUDAGraph, handle: int, device: torch.device) -> None:
        self.graph = graph
        self.index = device_index(device)
        self._handle = ctypes.c_void_p(handle)
        self._cu = _driver()
        self._finalizer = weakref.finalize(self, _destroy, self._cu, handle)

    def replay(self) -> None:
        """Launch into the current stream of the graph's device (ordered like
        ``CUDAGraph.replay()``: after the stream's earlier work, before its later work)."""
        if torch.cuda.current_device() != self.index:
            with torch.cuda.device(self.index):
                self._launch()
        else:
            self._launch()

    def _launch(self) -> None:
        stream = ctypes.c_void_p(current_raw_stream(self.index))
        rc = self._cu.cuGraphLaunch(self._handle, stream)
        if rc == _INVALID_CONTEXT:  # a thread that never made a CUDA call: bind the context
            with torch.cuda.device(self.index):
                torch.cuda.current_stream(self.index).query()
                rc = self._cu.cuGraphLaunch(self._handle, stream)
        if rc != 0:
            raise RuntimeError(f"cuGraphLaunch of a device-launch graph failed: CUDA driver "
                               f"error {rc}")

    def pool(self) -> Any:
        """The memory pool the graph was captured into (``CUDAGraph.pool()``)."""
        return self.graph.pool()

    def close(self) -> None:
        """Destroy the executable now (also done when this object is collected)."""
        self._finalizer()


def launch_kind(launcher: Any) -> str:
    """``"device"`` for a :class:`DeviceLaunchGraph`, ``"torch"`` for a ``CUDAGraph``."""
    return getattr(launcher, "kind", "torch")


def make_launcher(graph: torch.cuda.CUDAGraph, device: torch.device, mode: str,
                  uses_rng: bool | None) -> Any:
    """What to replay for ``graph`` (captured with ``keep_graph=True``): a
    :class:`DeviceLaunchGraph`, or ``graph`` instantiated by PyTorch (module docstring).

    Args:
        mode: the ``graph_launch`` option (``options.GRAPH_LAUNCHES``).
        uses_rng: whether the forward advanced the CUDA generator in its warm-up; ``None`` when
            unknown (no warm-up ran): then PyTorch's replay, which handles it either way.
    """
    reason = _device_launch_refused(mode, uses_rng)
    if reason is None:
        cu = _driver()
        handle = ctypes.c_void_p()
        with torch.cuda.device(device):
            rc = cu.cuGraphInstantiateWithFlags(ctypes.byref(handle),
                                                ctypes.c_void_p(graph.raw_cuda_graph()),
                                                _DEVICE_LAUNCH)
            if rc == 0:
                launcher = DeviceLaunchGraph(graph, handle.value, device)
                stream = torch.cuda.current_stream(device)
                rc = cu.cuGraphUpload(handle, ctypes.c_void_p(stream.cuda_stream))
                if rc == 0:
                    stream.synchronize()  # once per capture: the first launch finds it uploaded
                    return launcher
                launcher.close()
                reason = f"the driver's upload failed (CUDA driver error {rc})"
            else:
                reason = f"the driver refused device launch (CUDA driver error {rc})"
    _log_once(reason)
    graph.instantiate()
    return graph


def _device_launch_refused(mode: str, uses_rng: bool | None) -> str | None:
    if mode == "torch":
        return "graph_launch='torch'"
    if uses_rng is None:
        return "no warm-up ran (warmup_iters=0), so random-number use is unknown"
    if uses_rng:
        return ("the forward draws random numbers, whose offsets only CUDAGraph.replay() "
                "advances")
    driver = _driver()
    if isinstance(driver, BaseException):
        return f"the CUDA driver library did not load ({driver})"
    return None
