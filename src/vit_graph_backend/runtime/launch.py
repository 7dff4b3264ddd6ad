"""How a captured graph is launched: an executable made for device launch, or PyTorch's own.

``CUDAGraph.replay()``'s executable costs the host more per launch with every memset node (cuBLAS
adds them before large GEMMs); the same graph instantiated with
``CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH`` launches far cheaper (docs/performance.md).
:func:`make_launcher` returns a :class:`DeviceLaunchGraph` (driver calls through ``ctypes``), or the
``CUDAGraph`` instantiated by PyTorch with ``graph_launch="torch"``, for forwards that draw random
numbers (only PyTorch's replay advances the generator), or where the driver refuses.
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
    """The one stream every graph of ``device`` is captured on. One stream, because a pool's free
    blocks go only to allocations on the stream that freed them (smaller graphs reuse the larger
    ones' memory); one per device, because ``torch.cuda.graph``'s process-wide default stream
    lives on whichever device was current first, which breaks captures on other GPUs."""
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
        device: the graph's CUDA device (launches go to its current stream).
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
    """What to replay for ``graph``: a :class:`DeviceLaunchGraph`, or ``graph`` instantiated by
    PyTorch (module docstring). ``mode``: the ``graph_launch`` option; ``uses_rng``: whether the
    forward advanced the CUDA generator in its warm-up (``None``, unknown: PyTorch's replay)."""
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
