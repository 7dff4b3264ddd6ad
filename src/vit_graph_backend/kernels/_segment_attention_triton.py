"""The Triton kernel of ``segment_attention``: flash attention within segments of any length,
for head sizes that are not a power of two, on GPUs with TMA (compute capability 9.0+).

One program attends ``BLOCK_M`` rows of one segment for one head; programs are laid out segment
after segment and each finds its own from the offsets, so the grid is static and no block crosses
a segment's end. A head of 80 or 72 is read as a 64-wide part and a 16-wide tail through TMA
descriptors instead of one 128-wide tile. The masked last key block is a loop of at most one turn
(``if`` blocks there gave NaN); one pipeline stage made an illegal memory access (Triton 3.6).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._threaded_builds import build_side_by_side

__all__ = ["MIN_SLOTS", "attend", "precompile", "split_head"]

_LOG2E = 1.4426950408889634
#: The fewest segment slots a program scans for its own segment (a power of two).
MIN_SLOTS = 64


@triton.jit
def _keys(q0, q1, m_i, l_i, acc0, acc1, k0_desc, k1_desc, v0_desc, v1_desc, start, head,
          key_end, scale_log2, HEAD: tl.constexpr, TAIL: tl.constexpr, BLOCK_N: tl.constexpr,
          MASKED: tl.constexpr):
    """The online-softmax update of (m, l, acc0, acc1) by the keys from row ``start``; ``m``
    is kept in scaled log2 units, so the scale folds into the exponent's multiply-add."""
    k0 = tl.reshape(k0_desc.load([start, head, 0]), [BLOCK_N, HEAD])
    v0 = tl.reshape(v0_desc.load([start, head, 0]), [BLOCK_N, HEAD])
    scores = tl.dot(q0, tl.trans(k0))
    if TAIL > 0:
        k1 = tl.reshape(k1_desc.load([start, head, HEAD]), [BLOCK_N, TAIL])
        scores += tl.dot(q1, tl.trans(k1))
    if MASKED:
        keys = start + tl.arange(0, BLOCK_N)
        scores = tl.where(keys[None, :] < key_end, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1) * scale_log2)
    alpha = tl.exp2(m_i - m_new)
    weights = tl.exp2(scores * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(weights, 1)
    p = weights.to(v0.dtype)
    acc0 = acc0 * alpha[:, None] + tl.dot(p, v0)
    if TAIL > 0:
        v1 = tl.reshape(v1_desc.load([start, head, HEAD]), [BLOCK_N, TAIL])
        acc1 = acc1 * alpha[:, None] + tl.dot(p, v1)
    return m_new, l_i, acc0, acc1


# the segment count only masks the slot scan: specialising on it would only add compiles
@triton.jit(do_not_specialize=["segments"])
def _segment_attention(q0_desc, q1_desc, k0_desc, k1_desc, v0_desc, v1_desc, o_ptr, offsets,
                       segments, o_row, scale_log2, HEAD_DIM: tl.constexpr, HEAD: tl.constexpr,
                       TAIL: tl.constexpr, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    head = tl.program_id(0)
    program = tl.program_id(1)
    # this program's segment: the first whose blocks end past it (segments laid out in order)
    slot = tl.arange(0, SLOTS)
    starts = tl.load(offsets + slot, mask=slot < segments, other=0)
    ends = tl.load(offsets + slot + 1, mask=slot < segments, other=0)
    blocks = (ends - starts + BLOCK_M - 1) // BLOCK_M
    blocks_end = tl.cumsum(blocks, 0)
    segment = tl.sum((blocks_end <= program).to(tl.int32), 0)
    here = slot == segment  # all false past the last segment: the program has no rows
    seg_start = tl.sum(tl.where(here, starts, 0), 0)
    seg_end = tl.sum(tl.where(here, ends, 0), 0)
    first = seg_start + (program - tl.sum(tl.where(here, blocks_end - blocks, 0), 0)) * BLOCK_M
    q0 = tl.reshape(q0_desc.load([first, head, 0]), [BLOCK_M, HEAD])
    q1 = q0
    if TAIL > 0:
        q1 = tl.reshape(q1_desc.load([first, head, HEAD]), [BLOCK_M, TAIL])
    # every row sees its segment's first key, so m is finite after the first block
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_M, HEAD], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, TAIL if TAIL > 0 else 16], dtype=tl.float32)
    full_end = seg_start + (seg_end - seg_start) // BLOCK_N * BLOCK_N
    for start in range(seg_start, full_end, BLOCK_N):
        m_i, l_i, acc0, acc1 = _keys(q0, q1, m_i, l_i, acc0, acc1, k0_desc, k1_desc, v0_desc,
                                     v1_desc, start, head, seg_end, scale_log2, HEAD, TAIL,
                                     BLOCK_N, False)
    for start in range(full_end, seg_end, BLOCK_N):  # the last partial block: at most one
        m_i, l_i, acc0, acc1 = _keys(q0, q1, m_i, l_i, acc0, acc1, k0_desc, k1_desc, v0_desc,
                                     v1_desc, start, head, seg_end, scale_log2, HEAD, TAIL,
                                     BLOCK_N, True)
    # a program with no rows stores none (its l is 0: the quotient is never written)
    norm = 1.0 / l_i
    rows = first + tl.arange(0, BLOCK_M)
    live = (rows < seg_end)[:, None]
    at = o_ptr + rows.to(tl.int64)[:, None] * o_row + head * HEAD_DIM
    cols0 = tl.arange(0, HEAD)  # wider than a head of 8 (the part is at least 16 wide)
    tl.store(at + cols0[None, :], (acc0 * norm[:, None]).to(o_ptr.dtype.element_ty),
             mask=live & (cols0[None, :] < HEAD_DIM))
    if TAIL > 0:
        cols1 = HEAD + tl.arange(0, TAIL)
        tl.store(at + cols1[None, :], (acc1 * norm[:, None]).to(o_ptr.dtype.element_ty),
                 mask=live & (cols1[None, :] < HEAD_DIM))


def split_head(dim: int) -> tuple[int, int]:
    """``(part, tail)``: the head's first ``part`` columns (the largest power of two up to
    ``dim``, at least 16) and a tail tile of ``tail`` columns (a power of two, at least 16;
    0 where ``part`` covers the head)."""
    part = max(16, 1 << (dim.bit_length() - 1))
    rest = dim - part
    return part, (0 if rest <= 0 else max(16, triton.next_power_of_2(rest)))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
           scale: float, block_m: int = 128, block_n: int = 64, warps: int = 4,
           stages: int = 3) -> torch.Tensor:
    """Attention of ``(rows, heads, head_dim)`` q, k, v (each row's heads contiguous, rows and
    heads 16-byte aligned) within the segments of int32 cumulative ``offsets`` (the last equal
    to ``rows``: every row in some segment); a fresh contiguous output."""
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    grid, args, options = _arguments(q, k, v, offsets, scale, out,
                                     (block_m, block_n, warps, stages))
    _segment_attention[grid](*args, **options)
    return out


def precompile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
               scale: float, configs: Sequence[tuple[int, int, int, int]]) -> None:
    """Compile (or load from cache) the kernel :func:`attend` would launch for these arguments
    in each ``(block_m, block_n, warps, stages)`` configuration, side by side in threads,
    launching nothing; a failed build fails again at its launch."""
    # one row of output stands for the whole (same dtype, row stride and alignment)
    out = torch.empty((1, *q.shape[1:]), device=q.device, dtype=q.dtype)

    def build(config: tuple[int, int, int, int]) -> None:
        with torch.cuda.device(q.device):  # Triton compiles for the thread's current device
            grid, args, options = _arguments(q, k, v, offsets, scale, out, config)
            _segment_attention.warmup(*args, grid=grid, **options)

    build_side_by_side(build, configs)


def _arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
               scale: float, out: torch.Tensor, config: tuple[int, int, int, int]
               ) -> tuple[tuple[int, int], tuple[object, ...], dict[str, object]]:
    """The grid, arguments and options of an :func:`attend` launch writing into ``out``."""
    block_m, block_n, warps, stages = config
    rows, heads, dim = q.shape
    part, tail = split_head(dim)
    segments = offsets.numel() - 1

    def desc(x: torch.Tensor, block: int, width: int) -> TensorDescriptor:
        return TensorDescriptor(x, list(x.shape), list(x.stride()), [block, 1, width])

    width = tail if tail else part
    args = (desc(q, block_m, part), desc(q, block_m, width), desc(k, block_n, part),
            desc(k, block_n, width), desc(v, block_n, part), desc(v, block_n, width), out,
            offsets, segments, out.stride(0), scale * _LOG2E)
    # the slots a program scans: a power of two, at least MIN_SLOTS and ``segments``
    slots = max(MIN_SLOTS, triton.next_power_of_2(segments))
    options = dict(HEAD_DIM=dim, HEAD=part, TAIL=tail, SLOTS=slots, BLOCK_M=block_m,
                   BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return (heads, triton.cdiv(rows, block_m) + segments), args, options
