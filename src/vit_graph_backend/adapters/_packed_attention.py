"""Packed (variable-length) self-attention over segments of one sequence, three ways.

A packed tower attends within segments (frames, or Qwen2.5-VL windows) of one ``(rows, heads,
head_dim)`` sequence. :func:`packed_attention` picks:

1. ``varlen_attn`` (``torch.nn.attention.varlen``, PyTorch 2.11+) on CUDA in fp16/bf16: offsets
   are a tensor and ``max_seqlen`` a Python int, so it captures in a CUDA graph. Zero-length
   segments (a repeated offset) are skipped by the kernel.
2. A per-segment loop of SDPA calls when the offsets are known on the host (eager only: it
   slices with Python ints, exactly like HF's own non-flash path).
3. SDPA with a block-diagonal boolean mask built from the offsets with tensor ops only
   (``searchsorted``): capturable and correct on any device, but it materializes a
   ``rows x rows`` mask, so it is the CPU graph path and the reference, not a CUDA fast path.

Every row lies in some segment (the caller gives padding its own segment), so every row attends
at least to itself and no fully masked softmax row can produce NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["Segments", "masked_attention", "packed_attention", "segment_loop_attention",
           "varlen_supported"]

_VARLEN_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class Segments:
    """Attention segments of one packed sequence.

    Attributes:
        offsets: ``(n + 1,)`` int32 cumulative offsets on the sequence's device; the last equals
            the sequence's rows.
        max_seqlen: a Python int at least as large as the longest segment (fixed per budget in a
            graph: never read from ``offsets``).
        host_offsets: the same offsets as Python ints when known (eager), else ``None``.
    """

    offsets: torch.Tensor
    max_seqlen: int
    host_offsets: Sequence[int] | None = None


def varlen_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """True if flash varlen attention takes this dtype and head size."""
    return dtype in _VARLEN_DTYPES and head_dim % 8 == 0 and head_dim <= 256


def segment_loop_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           offsets: Sequence[int], scale: float) -> torch.Tensor:
    """Attention per segment with SDPA (eager only). ``q, k, v``: ``(rows, heads, head_dim)``."""
    pieces = []
    for start, stop in zip(offsets[:-1], offsets[1:], strict=True):
        if stop > start:
            qs, ks, vs = (x[start:stop].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            out = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
            pieces.append(out[0].transpose(0, 1))
    if not pieces:
        return torch.zeros_like(q)
    return torch.cat(pieces)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention with a block-diagonal mask built from ``offsets`` by tensor ops (capturable)."""
    rows = q.shape[0]
    positions = torch.arange(rows, device=q.device, dtype=offsets.dtype)
    segment = torch.searchsorted(offsets[1:].contiguous(), positions, right=True)
    mask = segment.unsqueeze(1) == segment.unsqueeze(0)
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments,
                     scale: float, varlen: Callable[..., Any] | None) -> torch.Tensor:
    """Attention of ``(rows, heads, head_dim)`` ``q, k, v`` within ``segments``.

    Args:
        scale: softmax scale; ``varlen`` is called without it and must default to the same value
            (``head_dim ** -0.5``, which is what the Qwen towers use).
        varlen: ``torch.nn.attention.varlen.varlen_attn``, or ``None`` where torch lacks it.
    """
    if varlen is not None and q.is_cuda and varlen_supported(q.dtype, q.shape[-1]):
        return varlen(q, k, v, segments.offsets, segments.offsets, segments.max_seqlen,
                      segments.max_seqlen)
    if segments.host_offsets is not None:
        return segment_loop_attention(q, k, v, segments.host_offsets, scale)
    return masked_attention(q, k, v, segments.offsets, scale)
