"""What the package's Triton attention kernels share: compiled once per shape outside CUDA-graph
capture, a shape whose first run fails remembered and left to the fallback kernel.

A shape met first inside a capture is served by the fallback (the warm-up before each capture
compiles it). A failed shape is refused for the process, unless it ran out of memory: then only
that call falls back. Used by ``short_attention`` and ``segment_attention``.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..errors import error_line, out_of_memory

__all__ = ["TritonKernelCalls", "inputs_reason", "layout_reason", "triton_reason"]

log = logging.getLogger(__name__)


def triton_reason() -> str | None:
    """Why Triton cannot be imported in this process, or ``None`` if it can."""
    try:
        importlib.import_module("triton")
    except Exception as exc:  # ImportError, or a broken install
        return f"triton is not importable ({type(exc).__name__}: {exc})"
    return None


_DTYPES = (torch.float16, torch.bfloat16)


def inputs_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                  kernel: str) -> str | None:
    """Why the Triton attention kernel ``kernel`` cannot take these offsets (contiguous 1-D
    int32) or dtypes (float16/bfloat16), or ``None``."""
    if offsets.dtype != torch.int32 or offsets.dim() != 1 or not offsets.is_contiguous():
        return (f"offsets of dtype {offsets.dtype} and shape {tuple(offsets.shape)} (the kernel "
                "takes a contiguous 1-D int32 tensor)")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} (the {kernel} takes float16/bfloat16)"
    return None


def layout_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why ``(rows, heads, head_dim)`` q, k, v are not laid out as the Triton attention kernels
    read them (same shape, each row's heads contiguous; any row stride), or ``None``."""
    dim = q.shape[-1]
    for name, x in zip("qkv", (q, k, v), strict=True):
        if x.shape != q.shape or x.stride(2) != 1 or x.stride(1) != dim:
            return (f"{name} of shape {tuple(x.shape)} and strides {x.stride()} (the kernel "
                    f"takes {tuple(q.shape)} with each row's heads contiguous)")
    return None


class TritonKernelCalls:
    """The compiled and refused shapes of one Triton kernel module (thread-safe).

    Args:
        module: the kernel's module, imported at the first call.
        what: the kernel's name in warnings; ``fallback``: the kernel that serves instead."""

    def __init__(self, module: str, what: str, fallback: str) -> None:
        self._module, self._what, self._fallback = module, what, fallback
        self._kernel: Any = None
        #: shape keys compiled by a call outside a capture
        self._ready: set[tuple[Any, ...]] = set()
        #: shape key -> why the kernel failed there (the fallback serves it)
        self.refused: dict[tuple[Any, ...], str] = {}
        self._lock = threading.Lock()

    @property
    def state(self) -> dict[str, Any]:
        """Shapes compiled (count) and shapes refused with their reasons."""
        with self._lock:
            return {"compiled": len(self._ready),
                    "refused": {str(key): why for key, why in self.refused.items()}}

    def _launch(self, key: tuple[Any, ...], device: torch.device,
                run: Callable[[Any], torch.Tensor]) -> torch.Tensor | None:
        """``run(kernel_module)`` for the shape ``key`` on ``device``, or ``None`` where the
        fallback serves (refused, first met inside a capture, or failed just now)."""
        if key in self._ready:
            return run(self._kernel)
        with self._lock:
            if key in self.refused or torch.cuda.is_current_stream_capturing():
                return None  # never compiled inside a capture: its warm-up run compiles it
            try:
                if self._kernel is None:
                    self._kernel = importlib.import_module(self._module)
                with torch.cuda.device(device):
                    out = run(self._kernel)
            except Exception as exc:  # Triton cannot compile or run it here
                reason = error_line(exc)
                if out_of_memory(exc):
                    log.warning("vitgraph: the %s for %s: %s; %s serves this call",
                                self._what, key, reason, self._fallback)
                    return None
                self.refused[key] = reason
                log.warning("vitgraph: the %s failed for %s (%s); %s serves it", self._what,
                            key, reason, self._fallback)
                return None
            self._ready.add(key)
            return out
