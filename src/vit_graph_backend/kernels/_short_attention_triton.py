"""The Triton kernel of ``short_attention``: attention within segments of at most 64 rows.

One program attends one segment for one head: whole ``BLOCK x WIDTH`` tiles of q, k, v (masked
to zero past the segment and head), one dot for the scores, the softmax in float32 registers (no
running maximum), a second dot for the output. Empty segments return at once: a graph's segment
buffer holds one slot per possible window, most empty in a given call.
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
    ``warps``: four by default (eight were slower at window shapes)."""
    rows, heads, dim = q.shape
    out = torch.empty((rows, heads, dim), device=q.device, dtype=q.dtype)
    width = max(16, triton.next_power_of_2(dim))
    _short_attention[(offsets.numel() - 1, heads)](
        q, k, v, out, offsets, q.stride(0), k.stride(0), v.stride(0), out.stride(0),
        scale * _LOG2E, HEAD_DIM=dim, BLOCK=block, WIDTH=width, num_warps=warps,
        num_stages=1)
    return out
