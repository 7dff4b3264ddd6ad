"""Attention within short segments (Qwen2.5-VL's windows, at most 64 rows) through one Triton kernel.

Flash varlen tiles queries by 128 rows, half empty for a window, and runs heads of 80 at 96 wide;
``_short_attention_triton`` attends a whole segment per program in registers, about twice as fast
at window shapes (docs/performance.md). :class:`ShortSegmentAttention` is called like
``cudnn_attention.RaggedAttention`` and returns ``None`` where it does not serve
(:func:`short_unserved_reason`, or no Triton); compiles and failures are handled by
``_triton_calls``. Which kernel serves each budget's window layers is timed at capture.
"""

from __future__ import annotations

import torch

from ._triton_calls import TritonKernelCalls, inputs_reason, layout_reason, triton_reason

__all__ = ["MAX_HEAD_DIM", "MAX_ROWS", "ShortSegmentAttention", "short_unserved_reason",
           "triton_reason"]

#: Longest segment the kernel takes: one register tile of rows (measured up to this size).
MAX_ROWS = 64
#: Widest head the kernel takes (its tile is the next power of two, at most 128).
MAX_HEAD_DIM = 128


def short_unserved_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          offsets: torch.Tensor, max_seqlen: int) -> str | None:
    """Why the kernel cannot serve these ``(rows, heads, head_dim)`` tensors with segments of up
    to ``max_seqlen`` rows, or ``None`` (the caller checks CUDA)."""
    dim = q.shape[-1]
    why = inputs_reason(q, k, v, offsets, "short-segment kernel")
    if why is not None:
        return why
    if max_seqlen > MAX_ROWS:
        return f"segments of up to {max_seqlen} rows (the kernel takes up to {MAX_ROWS})"
    if dim > MAX_HEAD_DIM:
        return f"head size {dim} (the kernel takes up to {MAX_HEAD_DIM})"
    return layout_reason(q, k, v)


class ShortSegmentAttention(TritonKernelCalls):
    """Segment attention through ``_short_attention_triton`` (thread-safe), called like
    ``RaggedAttention``; returns the output, or ``None`` where it does not serve."""

    def __init__(self) -> None:
        super().__init__("vit_graph_backend.kernels._short_attention_triton",
                         "short-segment attention kernel", "flash varlen")

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 offsets: torch.Tensor, max_seqlen: int, scale: float,
                 cache: dict | None = None) -> torch.Tensor | None:
        if not q.is_cuda or short_unserved_reason(q, k, v, offsets, max_seqlen) is not None:
            return None
        block = max(16, 1 << (max(max_seqlen, 1) - 1).bit_length())  # next power of two
        key = (q.device.index, q.dtype, block, q.shape[-1])
        return self._launch(key, q.device,
                            lambda kernel: kernel.attend(q, k, v, offsets, block, scale))
