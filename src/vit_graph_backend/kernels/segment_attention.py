"""Full attention over segments through one Triton flash-attention kernel that tiles a head of 80
or 72 as 64 + 16 columns (``_segment_attention_triton``).

cuDNN's ragged kernel computes heads of 80 and 72 at the cost of 128. This kernel is faster on
some layouts and slower on others (docs/performance.md), so which serves each budget is timed at
capture (``attention_choice``). :class:`SegmentFlashAttention` is called like
``cudnn_attention.RaggedAttention`` and returns ``None`` where it does not serve
(:func:`segment_unserved_reason`, or no Triton); it compiles outside capture and remembers failed
shapes (``_triton_calls``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ._triton_calls import TritonKernelCalls, inputs_reason, layout_reason

__all__ = ["MAX_HEAD_DIM", "MAX_SEGMENTS", "SegmentFlashAttention", "segment_unserved_reason"]

#: Widest head the kernel takes (a 128-wide part and a tail of up to 128).
MAX_HEAD_DIM = 256
#: Most segment slots the kernel takes: each program scans every slot's offsets to find its own.
MAX_SEGMENTS = 4096


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def segment_unserved_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            offsets: torch.Tensor) -> str | None:
    """Why the kernel cannot serve these ``(rows, heads, head_dim)`` tensors within the segments
    at ``offsets``, or ``None`` (the caller checks CUDA first)."""
    rows, heads, dim = q.shape
    why = inputs_reason(q, k, v, offsets, "segment kernel")
    if why is not None:
        return why
    if offsets.numel() - 1 > MAX_SEGMENTS:
        return (f"{offsets.numel() - 1} segment slots (the kernel takes up to {MAX_SEGMENTS})")
    if dim % 8 or dim > MAX_HEAD_DIM:
        return f"head size {dim} (the kernel takes multiples of 8 up to {MAX_HEAD_DIM})"
    if rows >= 2 ** 31:
        return f"{rows} rows (TMA coordinates are 32-bit)"
    why = layout_reason(q, k, v)
    if why is not None:
        return why
    for name, x in zip("qkv", (q, k, v), strict=True):
        if x.data_ptr() % 16 or (x.stride(0) * x.element_size()) % 16:
            return (f"{name} with row stride {x.stride(0)} at address {x.data_ptr():#x} (TMA "
                    "needs rows 16-byte aligned)")
    if q.is_cuda and _capability(q.device.index) < (9, 0):
        major, minor = _capability(q.device.index)
        return (f"compute capability {major}.{minor} (the kernel reads through TMA, 9.0 and "
                "newer)")
    return None


class SegmentFlashAttention(TritonKernelCalls):
    """Full attention within segments through ``_segment_attention_triton`` (thread-safe), called
    like ``RaggedAttention`` (``max_seqlen`` and ``cache`` unused); returns the output, or
    ``None`` where it does not serve."""

    def __init__(self) -> None:
        super().__init__("vit_graph_backend.kernels._segment_attention_triton",
                         "segment attention kernel", "cuDNN or flash varlen")

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 offsets: torch.Tensor, max_seqlen: int, scale: float,
                 cache: dict[Any, torch.Tensor] | None = None) -> torch.Tensor | None:
        if not q.is_cuda or segment_unserved_reason(q, k, v, offsets) is not None:
            return None
        key = (q.device.index, q.dtype, q.shape[-1])
        return self._launch(key, q.device,
                            lambda kernel: kernel.attend(q, k, v, offsets, scale))
