"""Operands, references and served-tower comparisons that the Triton attention kernels' GPU tests
share (``tests/gpu/test_short_attention_gpu.py``, ``tests/gpu/test_segment_attention_gpu.py``)."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

DEV = "cuda"


def _layout(rows, heads, dim, dtype, gen):
    qk = torch.randn(rows, 2, heads, dim, device=DEV, dtype=dtype, generator=gen)
    qkv = torch.randn(rows, 3, heads, dim, device=DEV, dtype=dtype, generator=gen)
    return qk[:, 0], qk[:, 1], qkv[:, 2]


def _offsets(lengths):
    ends = torch.tensor(lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return F.pad(ends, (1, 0)).to(DEV)


def _reference(q, k, v, lengths, scale):
    out, start = torch.zeros(q.shape, device=DEV), 0
    for n in lengths:
        if n:
            qs, ks, vs = (x[start:start + n].float().transpose(0, 1) for x in (q, k, v))
            out[start:start + n] = F.scaled_dot_product_attention(
                qs, ks, vs, scale=scale).transpose(0, 1)
        start += n
    return out


def _served_errors(tower, default, flash, max_rows=None):
    """The largest relative errors of the served tower ``default`` against HF's ``tower`` and
    against ``flash`` (served with ``packed_attention="varlen"``), over six calls of one to three
    random images (one image where they would pass ``max_rows``), scaled by the output's
    largest magnitude (at least 1)."""
    rng = random.Random(5)
    worst_hf = worst_flash = 0.0
    for _ in range(6):
        grids = [[1, 2 * rng.randint(4, 16), 2 * rng.randint(4, 16)]
                 for _ in range(rng.randint(1, 3))]
        if max_rows is not None and sum(t * h * w for t, h, w in grids) > max_rows:
            grids = grids[:1]
        rows = sum(t * h * w for t, h, w in grids)
        pv = torch.randn(rows, 3 * 2 * 14 * 14, device=DEV, dtype=torch.bfloat16)
        grid = torch.tensor(grids, device=DEV)
        got, ref, other = default(pv, grid), tower(pv, grid).pooler_output, flash(pv, grid)
        scale = max(ref.float().abs().max().item(), 1.0)
        worst_hf = max(worst_hf, (got.float() - ref.float()).abs().max().item() / scale)
        worst_flash = max(worst_flash, (got.float() - other.float()).abs().max().item() / scale)
    return worst_hf, worst_flash


def _first_call_in_a_capture(kernel, dim, lengths, max_len):
    """``kernel``'s output for a shape it first meets inside a CUDA-graph capture (2 heads of
    ``dim``, segments of ``lengths``, bf16)."""
    gen = torch.Generator(device=DEV).manual_seed(4)
    q, k, v = _layout(sum(lengths), 2, dim, torch.bfloat16, gen)
    offsets = _offsets(lengths)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        return kernel(q, k, v, offsets, max_len, dim ** -0.5)
