"""Triton kernels for ``act(x @ W.T + b)`` with the activation applied in the GEMM's epilogue.

Imported only when :mod:`vit_graph_backend.kernels.fused_linear` runs on CUDA. The GEMM is
persistent (one program per SM walking output tiles in ``GROUP_M`` groups, for L2 reuse of weight
tiles) and loads through Hopper's TMA with host-side descriptors, which a CUDA graph captures by
value; the fp32 accumulator is rounded once, after bias and activation. ``activation_`` and
``silu_mul_packed`` are the same epilogues as separate kernels after a cuBLAS GEMM. ``silu_mul``
reads a weight packing gate and up in alternating ``BN // 2``-row chunks, so each tile writes only
``silu(gate) * up``. The GEMM is not specialised on its row count, so one compile per tile
configuration serves every budget, and :func:`precompile` builds configurations in threads.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._threaded_builds import build_side_by_side

__all__ = ["ACTIVATIONS", "CONFIGS", "activation_", "linear_act", "precompile",
           "silu_mul_packed"]

#: Activation name -> the code the kernels branch on (0 is none; 4 the gated form).
ACTIVATIONS = {"none": 0, "quick_gelu": 1, "gelu": 2, "gelu_tanh": 3, "silu_mul": 4}
_GATED = 4

#: Tile configurations (BM, BN, BK, stages, warps, warp-specialized[, programs per SM]); the
#: first is the default. Programs per SM above 1 (default 1) overlap one program's epilogue with
#: another's GEMM, for tiles small enough that two fit.
CONFIGS = (
    (128, 256, 64, 3, 8, 0),
    (128, 256, 64, 4, 8, 0),
    (256, 128, 64, 3, 8, 0),
    (128, 128, 64, 4, 8, 0),
    (128, 128, 64, 5, 4, 0),
)


@triton.jit
def _tanh(x, APPROX: tl.constexpr):
    if APPROX:  # one special-function op (max relative error 2**-10.7, below bf16's 2**-8)
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _act(x, ACT: tl.constexpr, APPROX: tl.constexpr):
    # sigmoid(v) = (1 + tanh(v / 2)) / 2: tanh is one special-function op, exp + divide two
    if ACT == 1:  # HF QuickGELUActivation: x * sigmoid(1.702 x)
        x = 0.5 * x * (1.0 + _tanh(0.851 * x, APPROX))
    elif ACT == 2:  # exact GELU
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 3:  # GELU, tanh approximation
        x = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x), APPROX))
    return x


@triton.jit
def _silu(x, APPROX: tl.constexpr):
    return 0.5 * x * (1.0 + _tanh(0.5 * x, APPROX))  # x * sigmoid(x), as in _act


@triton.jit
def _tile(tile, num_m, num_n, GROUP_M: tl.constexpr):
    width = GROUP_M * num_n
    first_m = (tile // width) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % width) % rows, (tile % width) // rows


# the row count only sizes the tile loop: specialising on it would only add compiles
@triton.jit(do_not_specialize=["M"])
def _linear_act_kernel(x_desc, w_desc, out_desc, bias_ptr, M, N, K,
                       HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                       PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                       APPROX: tl.constexpr):
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        pm, pn = _tile(tile, num_m, num_n, GROUP_M)
        om = pm * BM
        on = pn * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kt in range(k_tiles):
            a = x_desc.load([om, kt * BK])
            w = w_desc.load([on, kt * BK])
            acc = tl.dot(a, w.T, acc)
        if HAS_BIAS:
            cols = on + tl.arange(0, BN)
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if ACT == 4:  # the tile's first half of columns is a gate chunk, its second the up chunk
            gate, up = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
            out_desc.store([om, pn * (BN // 2)], (_silu(gate, APPROX) * up).to(out_desc.dtype))
        else:  # two half-width stores: half the shared memory the copy out needs
            acc = _act(acc, ACT, APPROX)
            lo, hi = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
            out_desc.store([om, on], lo.to(out_desc.dtype))
            out_desc.store([om, on + BN // 2], hi.to(out_desc.dtype))


@triton.jit
def _activation_kernel(x_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    tl.store(x_ptr + offs, _act(x, ACT, False).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_packed_kernel(y_ptr, out_ptr, n, width, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    row, col = offs // width, offs % width
    src = row * (2 * width) + (col // CHUNK) * (2 * CHUNK) + col % CHUNK
    g = tl.load(y_ptr + src, mask=mask).to(tl.float32)
    u = tl.load(y_ptr + src + CHUNK, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (_silu(g, False) * u).to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def linear_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               activation: str, config: tuple[int, ...] = CONFIGS[0], *,
               approx: bool = True) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` for 2-D contiguous ``x`` ([M, K]) and ``weight`` ([N, K]) of
    one 16-bit dtype, ``K`` and ``N`` multiples of 8 (the descriptors' 16-byte strides).
    ``approx``: the GELUs' tanh as the hardware's approximate instruction. ``"silu_mul"``: the
    gated form, ``weight`` packed in chunks of ``BN // 2`` rows (``N`` a multiple of ``BN``),
    output ``[M, N // 2]``."""
    out, grid, args, options = _arguments(x, weight, bias, activation, config, approx)
    _linear_act_kernel[grid](*args, **options)
    return out


def precompile(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               activation: str, configs: Sequence[tuple[int, ...]], *,
               approx: bool = True) -> None:
    """Compile (or load from cache) the kernel of each configuration :func:`linear_act` would
    launch for these arguments, side by side in threads, launching nothing. A failed build fails
    again at its launch, where the caller sees why."""
    # a few rows stand for all: the kernel is not specialised on the row count
    rows = x[:128]

    def build(config: tuple[int, ...]) -> None:
        with torch.cuda.device(x.device):  # Triton compiles for the thread's current device
            _, grid, args, options = _arguments(rows, weight, bias, activation, config, approx)
            _linear_act_kernel.warmup(*args, grid=grid, **options)

    build_side_by_side(build, configs)


def _arguments(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               activation: str, config: tuple[int, ...], approx: bool
               ) -> tuple[torch.Tensor, tuple[int], tuple[object, ...], dict[str, object]]:
    """The output, grid, arguments and options of a :func:`linear_act` launch."""
    bm, bn, bk, stages, warps, specialize, *per_sm = config
    m, k = x.shape
    gated = ACTIVATIONS[activation] == _GATED
    if gated and weight.shape[0] % bn:
        raise ValueError(f"a packed gated weight of {weight.shape[0]} rows does not split into "
                         f"tiles of {bn}")
    n = weight.shape[0]
    out = torch.empty((m, n // 2 if gated else n), device=x.device, dtype=x.dtype)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    sms = _num_sms(x.device.index if x.device.index is not None else torch.cuda.current_device())
    programs = sms * (per_sm[0] if per_sm else 1)  # a constant: not one compile per row count
    args = (TensorDescriptor.from_tensor(x, [bm, bk]),
            TensorDescriptor.from_tensor(weight, [bn, bk]),
            TensorDescriptor.from_tensor(out, [bm, bn // 2]), out if bias is None else bias,
            m, n, k)
    options = dict(HAS_BIAS=bias is not None, ACT=ACTIVATIONS[activation], BM=bm, BN=bn, BK=bk,
                   GROUP_M=8, PROGRAMS=programs, WARP_SPECIALIZE=bool(specialize), APPROX=approx,
                   num_stages=stages, num_warps=warps)
    return out, (min(programs, tiles),), args, options


def activation_(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``x`` (contiguous) replaced by ``act(x)``, computed in fp32; returns ``x``."""
    n = x.numel()
    block = 2048
    _activation_kernel[(triton.cdiv(n, block),)](x, n, ACT=ACTIVATIONS[activation], BLOCK=block,
                                                 num_warps=8)
    return x


def silu_mul_packed(y: torch.Tensor, chunk: int) -> torch.Tensor:
    """``silu(gate) * up`` of ``y`` (contiguous ``[M, 2 * W]``: gate and up columns alternating
    in chunks of ``chunk``), computed in fp32, as a new ``[M, W]`` tensor."""
    width = y.shape[-1] // 2
    out = torch.empty((*y.shape[:-1], width), device=y.device, dtype=y.dtype)
    n = out.numel()
    block = 2048
    _silu_mul_packed_kernel[(triton.cdiv(n, block),)](y, out, n, width, CHUNK=chunk, BLOCK=block,
                                                      num_warps=8)
    return out
