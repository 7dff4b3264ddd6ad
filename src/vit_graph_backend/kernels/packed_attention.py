"""Packed (variable-length) self-attention over segments of one ``(rows, heads, head_dim)``
sequence. :func:`packed_attention` picks: dense SDPA with padding keys hidden by an extra head
channel (one-segment budgets; a mask would cost SDPA its fastest kernel), ``varlen_attn`` on CUDA
in fp16/bf16 (capturable; a ``ragged`` kernel tried first in graphs), a per-segment SDPA loop with
host offsets (eager), or SDPA with a block-diagonal mask (any device; the reference). Padding has
its own segment, so every row attends at least to itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["Segments", "dense_sdpa", "key_masked_attention", "masked_attention",
           "packed_attention", "segment_loop_attention", "varlen_attention", "varlen_supported",
           "wide_width", "widen_for_dense"]

_VARLEN_DTYPES = (torch.float16, torch.bfloat16)

#: The extra key channel of a padding row (the query's is 1): times any softmax scale of a head
#: up to 256 wide the score is below -60000, whose exp is 0 in float32.
_HIDDEN_KEY = -1e6


@dataclass
class Segments:
    """Attention segments of one packed sequence.

    Attributes:
        offsets: ``(n + 1,)`` int32 cumulative offsets on the sequence's device; the last equals
            the sequence's rows.
        max_seqlen: a Python int at least as large as the longest segment (fixed per budget in a
            graph: never read from ``offsets``).
        host_offsets: the same offsets as Python ints when known (eager), else ``None``."""

    offsets: torch.Tensor
    max_seqlen: int
    host_offsets: Sequence[int] | None = None
    #: one real segment ``[0, offsets[1])`` then padding only: dense attention may serve it
    dense: bool = False
    #: tensors derived from ``offsets`` once per forward, shared by its layers (cuDNN's layout)
    derived: dict[Any, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)


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
    return torch.cat(pieces) if pieces else torch.zeros_like(q)


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


def wide_width(head_dim: int) -> int:
    """Head width of :func:`widen_for_dense`'s buffer: at least one extra channel, rounded up to
    a multiple of 16 (SDPA needs 8, but cuDNN's dense kernel is faster at 16)."""
    return (head_dim // 16 + 1) * 16


def widen_for_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor
                    ) -> torch.Tensor:
    """``(3, rows, heads, wide_width(head_dim))``: q, k and v with the extra channel that hides
    the keys at rows ``>= real`` (a ``(1,)`` tensor: the real segment's end), zeros after it.

    The channel is 1 in every query, 0 in real keys, ``_HIDDEN_KEY`` in padding keys and 0 in v.
    Written as cat and pad so Inductor fuses it with the rotary embedding
    (``fused_ops.rotate_qk_wide``)."""
    rows, heads, dim = q.shape
    width = wide_width(dim)
    hidden = torch.arange(rows, device=q.device) >= real
    key_channel = torch.where(hidden, _HIDDEN_KEY, 0.0).to(k.dtype).view(rows, 1, 1)
    ones = torch.ones_like(key_channel).expand(rows, heads, 1)
    pad = (0, width - dim - 1)
    return torch.stack([F.pad(torch.cat([q, ones], -1), pad),
                        F.pad(torch.cat([k, key_channel.expand(rows, heads, 1)], -1), pad),
                        F.pad(v, (0, width - dim))])


def dense_sdpa(wide: torch.Tensor, head_dim: int, scale: float) -> torch.Tensor:
    """One SDPA call over :func:`widen_for_dense`'s buffer; ``(rows, heads, head_dim)``."""
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in wide.unbind(0))
    out = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
    return out[0, ..., :head_dim].transpose(0, 1)


def key_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         segments: Segments, scale: float) -> torch.Tensor:
    """Dense SDPA over all rows where only rows ``[0, offsets[1])`` are keys.

    Through :func:`widen_for_dense`: real rows' outputs are exactly segment attention's;
    padding rows attend to the real keys (finite values nobody reads)."""
    wide = widen_for_dense(q, k, v, segments.offsets[1:2])
    return dense_sdpa(wide, q.shape[-1], scale)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments,
                     scale: float, varlen: Callable[..., Any],
                     ragged: Callable[..., torch.Tensor | None] | None = None) -> torch.Tensor:
    """Segment attention through ``ragged`` (e.g. cuDNN's) for a graph's segments (no host
    offsets) where it serves the shape, else ``varlen`` (flash varlen)."""
    if ragged is not None and segments.host_offsets is None:
        out = ragged(q, k, v, segments.offsets, segments.max_seqlen, scale, segments.derived)
        if out is not None:
            return out
    return varlen(q, k, v, segments.offsets, segments.offsets, segments.max_seqlen,
                  segments.max_seqlen)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments,
                     scale: float, varlen: Callable[..., Any] | None,
                     ragged: Callable[..., torch.Tensor | None] | None = None) -> torch.Tensor:
    """Attention of ``(rows, heads, head_dim)`` ``q, k, v`` within ``segments``.

    Args:
        scale: softmax scale; ``varlen`` is called without it and must default to the same
            value (``head_dim ** -0.5``).
        varlen: ``torch.nn.attention.varlen.varlen_attn`` (``_compat.get_varlen_attn``).
        ragged: cuDNN's ragged attention to try first where flash varlen would serve a graph's
            segments (:func:`varlen_attention`), or ``None``."""
    if segments.dense:
        return key_masked_attention(q, k, v, segments, scale)
    if varlen is not None and q.is_cuda and varlen_supported(q.dtype, q.shape[-1]):
        return varlen_attention(q, k, v, segments, scale, varlen, ragged)
    if segments.host_offsets is not None:
        return segment_loop_attention(q, k, v, segments.host_offsets, scale)
    return masked_attention(q, k, v, segments.offsets, scale)
