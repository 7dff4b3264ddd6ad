"""Attention within short segments (Qwen2.5-VL's windows) through one Triton kernel.

A Qwen2.5-VL window holds at most 64 rows (112 px windows of 14 px patches). Flash varlen
attention tiles queries by 128 rows, so half of each tile is empty, and its head-size-80 kernel
runs 96 wide: at 16,384 rows (16 heads of 80, a graph's 1,281 segment slots, most of them empty)
a window layer took 0.146 ms on an H100, about 2.6x what moving q, k, v and the output through
memory takes. ``_short_attention_kernel`` attends a whole segment per program in registers:
0.076 ms there, 0.020 against 0.035 ms at 4,096 rows, same error against float32
(``benchmarks/results/window_attention_kernel_probe_*``).

:class:`ShortSegmentAttention` is called like ``_cudnn_attention.RaggedAttention`` and returns
``None`` where it does not serve (the caller then runs flash varlen): tensors not on CUDA, a
dtype other than float16/bfloat16, segments longer than :data:`MAX_ROWS`, heads wider than
:data:`MAX_HEAD_DIM`, a head not contiguous within its row, or Triton missing. The kernel compiles
at its first call for a shape; a shape met first inside a CUDA-graph capture is served by flash
varlen (the runtime's warm-up run before each capture compiles it). A shape whose first run fails
is left to flash varlen for the process, unless it ran out of memory: that is the moment's
memory, and the next call tries again. Which of the two serves each
budget's window layers is measured at capture (``_attention_choice``).
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Any

import torch

__all__ = ["MAX_HEAD_DIM", "MAX_ROWS", "ShortSegmentAttention", "short_unserved_reason",
           "triton_reason"]

log = logging.getLogger(__name__)

#: Longest segment the kernel takes: one register tile of rows (measured up to this size).
MAX_ROWS = 64
#: Widest head the kernel takes (its tile is the next power of two, at most 128).
MAX_HEAD_DIM = 128
_DTYPES = (torch.float16, torch.bfloat16)


def triton_reason() -> str | None:
    """Why the kernel cannot be imported in this process, or ``None`` if it can."""
    try:
        importlib.import_module("triton")
    except Exception as exc:  # ImportError, or a broken install
        return f"triton is not importable ({type(exc).__name__}: {exc})"
    return None


def short_unserved_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          offsets: torch.Tensor, max_seqlen: int) -> str | None:
    """Why the kernel cannot serve these ``(rows, heads, head_dim)`` tensors with segments of up
    to ``max_seqlen`` rows at ``offsets``, or ``None`` if it can (on any device: the caller
    checks CUDA)."""
    dim = q.shape[-1]
    if offsets.dtype != torch.int32 or offsets.dim() != 1 or not offsets.is_contiguous():
        # the kernel reads offsets as packed int32: anything else would be misread
        return (f"offsets of dtype {offsets.dtype} and shape {tuple(offsets.shape)} (the kernel "
                "takes a contiguous 1-D int32 tensor)")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} (the short-segment kernel takes float16/bfloat16)"
    if max_seqlen > MAX_ROWS:
        return f"segments of up to {max_seqlen} rows (the kernel takes up to {MAX_ROWS})"
    if dim > MAX_HEAD_DIM:
        return f"head size {dim} (the kernel takes up to {MAX_HEAD_DIM})"
    for name, x in zip("qkv", (q, k, v), strict=True):
        if x.shape != q.shape or x.stride(2) != 1 or x.stride(1) != dim:
            return (f"{name} of shape {tuple(x.shape)} and strides {x.stride()} (the kernel "
                    f"takes {tuple(q.shape)} with each row's heads contiguous)")
    return None


class ShortSegmentAttention:
    """Segment attention through ``_short_attention_kernel`` (module docstring).

    Call it with ``(rows, heads, head_dim)`` q, k, v, the segments' cumulative int32 ``offsets``
    and a static ``max_seqlen``; it returns the attention output, or ``None`` where it does not
    serve. Thread-safe: one lock covers the table of compiled and refused shapes.
    """

    def __init__(self) -> None:
        self._kernel: Any = None
        #: (device index, dtype, block, head size) compiled by a call outside a capture
        self._ready: set[tuple[Any, ...]] = set()
        #: shape key -> why the kernel failed there (flash varlen serves it)
        self.refused: dict[tuple[Any, ...], str] = {}
        self._lock = threading.Lock()

    @property
    def state(self) -> dict[str, Any]:
        """Shapes compiled (count) and shapes refused with their reasons."""
        with self._lock:
            return {"compiled": len(self._ready),
                    "refused": {str(key): why for key, why in self.refused.items()}}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 offsets: torch.Tensor, max_seqlen: int, scale: float,
                 cache: dict[Any, torch.Tensor] | None = None) -> torch.Tensor | None:
        if not q.is_cuda or short_unserved_reason(q, k, v, offsets, max_seqlen) is not None:
            return None
        block = max(16, 1 << (max(max_seqlen, 1) - 1).bit_length())  # next power of two
        key = (q.device.index, q.dtype, block, q.shape[-1])
        if key in self._ready:
            return self._kernel.attend(q, k, v, offsets, block, scale)
        with self._lock:
            if key in self.refused or torch.cuda.is_current_stream_capturing():
                return None  # never compiled inside a capture: its warm-up run compiles it
            try:
                if self._kernel is None:
                    self._kernel = importlib.import_module(
                        "vit_graph_backend.adapters._short_attention_kernel")
                with torch.cuda.device(q.device):
                    out = self._kernel.attend(q, k, v, offsets, block, scale)
            except Exception as exc:  # Triton cannot compile or run it here
                first = str(exc).splitlines()[0] if str(exc) else ""
                reason = f"{type(exc).__name__}: {first}"
                if isinstance(exc, torch.OutOfMemoryError):
                    # the moment's memory, not the shape: flash varlen serves this call only
                    log.warning("vitgraph: the short-segment attention kernel ran out of memory "
                                "for %s (%s); flash varlen serves this call", key, reason)
                    return None
                self.refused[key] = reason
                log.warning("vitgraph: the short-segment attention kernel failed for %s (%s); "
                            "flash varlen serves it", key, reason)
                return None
            self._ready.add(key)
            return out
