"""The Triton kernel of ``_short_attention``: attention within segments of at most 64 rows.

Imported only on CUDA, by :class:`~._short_attention.ShortSegmentAttention` (Triton is not
installed with PyTorch's CPU wheels). One program attends one segment for one head: it loads the
segment's q, k and v rows whole (a ``BLOCK x WIDTH`` tile each, the rows past the segment's end
and the columns past the head size masked to zero), computes the scores with one tensor-core dot,
the softmax in float32 in registers (no running maximum: the whole row is there) and the output
with a second dot, divided by the row sums at the end (as flash attention does). A program whose
segment is empty returns at once: a graph's segment buffer holds one slot per possible window,
most of them empty in a given call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["attend"]

_LOG2E = 1.4426950408889634


@triton.jit
def _short_attention(q_ptr, k_ptr, v_ptr, o_ptr, offsets, q_row, k_row, v_row, o_row, scale_log2,
                    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
    segment = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(offsets + segment)
    count = tl.load(offsets + segment + 1) - start
    if count > 0:
        rows = tl.arange(0, BLOCK)
        cols = tl.arange(0, WIDTH)
        live = rows < count
        mask = live[:, None] & (cols[None, :] < HEAD_DIM)
        at = (start + rows).to(tl.int64)[:, None]  # int64: row x stride may pass 2**31
        col = head * HEAD_DIM + cols[None, :]
        q = tl.load(q_ptr + at * q_row + col, mask=mask, other=0.0)
        k = tl.load(k_ptr + at * k_row + col, mask=mask, other=0.0)
        v = tl.load(v_ptr + at * v_row + col, mask=mask, other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale_log2
        scores = tl.where(live[None, :], scores, float("-inf"))
        weights = tl.exp2(scores - tl.max(scores, 1)[:, None])
        total = tl.sum(weights, 1)
        out = tl.dot(weights.to(v.dtype), v) / total[:, None]
        tl.store(o_ptr + at * o_row + col, out.to(o_ptr.dtype.element_ty), mask=mask)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
           block: int, scale: float, warps: int = 4) -> torch.Tensor:
    """Attention of ``(rows, heads, head_dim)`` q, k, v (heads contiguous within a row, any row
    stride) within the segments of int32 ``offsets``, each at most ``block`` rows (a power of
    two, 16 to 64); a fresh contiguous output. Rows outside every segment are left unwritten.

    ``warps``: four (the default) because eight were 10 to 35 % slower on an H100 at the
    Qwen2.5-VL-3B window shapes (``benchmarks/results/window_attention_kernel_probe_*``).
    """
    rows, heads, dim = q.shape
    out = torch.empty((rows, heads, dim), device=q.device, dtype=q.dtype)
    width = max(16, triton.next_power_of_2(dim))
    _short_attention[(offsets.numel() - 1, heads)](
        q, k, v, out, offsets, q.stride(0), k.stride(0), v.stride(0), out.stride(0),
        scale * _LOG2E, HEAD_DIM=dim, BLOCK=block, WIDTH=width, num_warps=warps,
        num_stages=1)
    return out
