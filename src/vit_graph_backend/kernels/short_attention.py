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
memory, and the next call tries again (``_triton_calls``). Which of the two serves each
budget's window layers is measured at capture (``_attention_choice``).
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
    to ``max_seqlen`` rows at ``offsets``, or ``None`` if it can (on any device: the caller
    checks CUDA)."""
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
    """Segment attention through ``_short_attention_kernel`` (module docstring).

    Call it with ``(rows, heads, head_dim)`` q, k, v, the segments' cumulative int32 ``offsets``
    and a static ``max_seqlen``; it returns the attention output, or ``None`` where it does not
    serve. Thread-safe (``_triton_calls.TritonKernelCalls``).
    """

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
