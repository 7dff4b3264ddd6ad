"""``quantization="fp8"``: the linear layers of a compiled graph as FP8 (e4m3) GEMMs.

:func:`quantize_linears` rewrites a Dynamo graph before the inner compiler sees it. Each
``F.linear`` whose weight is a parameter (2-D, both sides multiples of 16, as cuBLASLt's FP8
kernels need) becomes :func:`fp8_linear`:

- the weight is quantized **once**, per output channel (one fp32 scale per row of ``W``), into
  buffers the graph reads (the user's parameter is not touched);
- the activation is quantized **per row at run time** (one scale per token), inside the graph;
- the GEMM is cuBLASLt's row-wise scaled FP8 matmul with the bias in its epilogue, output bf16,
  cast back to what the original layer returned.

On Hopper (compute capability 9.0), a layer whose input rows are wider than 1,024 columns (a
ViT's fc2, after the GELU) is **block-scaled** instead: one activation scale per 128 columns of
a row, the weight in 128x128 blocks (:func:`scaling_for`), through the public
``torch.nn.functional.scaled_mm``. A per-row scale of such a row is a
reduction Inductor runs in two passes over it after the GELU, which cost what the FP8 GEMMs saved;
a 1x128 block's is local to the block. At CLIP ViT-L/14-336's fc2 with 27,696 rows on an H100,
GELU and quantization took 0.232 ms by blocks against 0.393 by rows, and the block-scaled GEMM
0.198 against the row-scaled 0.207 ms (bf16: 0.295), with the same error against its dequantized
operands. Narrower inputs stay row-scaled: after a LayerNorm (a row reduction already) the
per-row scale is nearly free, 0.040 ms against 0.110 by blocks at 1,024 columns
(``benchmarks/results/fp8_block_scaled_gemm_and_quantizing_kernels_*``). The block-scaled GEMM
is measured only on Hopper, and PyTorch runs it only there.

Its limits, found on torch 2.11 with CUDA 13 on an H100
(``benchmarks/results/fp8_block_scaled_gemm_scale_layouts_*``): the weight's scales are read in
groups of 4 blocks of K, so K must be a multiple of 512 (``F.scaled_mm`` refuses other K;
``torch._scaled_mm`` took them and returned wrong numbers, a block of 128 columns all zeros), and
cuBLASLt refuses a row count that is not a multiple of 4, so the GEMM's op pads such rows.

Per-row activation scales cost a reduction over every row before each GEMM. Run as separate
kernels that costs more than FP8 saves (``benchmarks/results/fp8_linear_probe_*``), so the option
needs ``inner_compiler="inductor"``, which fuses the quantization into the LayerNorm or GELU
before it (checked in ``options.py``).

The weight copies must follow the parameters: :meth:`Fp8Weights.refresh`, called before every
call of the graph (``backend.py``), re-quantizes a weight whose storage moved (a replaced
parameter) or whose version counter moved (``load_state_dict`` and other in-place writes), into the
same buffers, so captured CUDA graphs read the new values. Weights created under
``torch.inference_mode`` have no version counter; only replacement is seen for them, and the
backend logs that once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import _compat
from .errors import InvalidOptionError
from .linear_rewrite import linear_layers

__all__ = ["BLOCK", "E4M3_MAX", "FP8_MIN_CAPABILITY", "Fp8Weights", "block_scaled_mm",
           "check_fp8_device", "fp8_linear", "fp8_linear_blocks", "graph_device", "quantize_blocks", "quantize_linears",
           "quantize_rows", "quantize_weight", "quantize_weight_blocks", "scaling_for"]

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)
#: FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer.
FP8_MIN_CAPABILITY = (8, 9)
#: cuBLASLt's FP8 GEMMs need both matrix sides in multiples of 16.
_ALIGN = 16
#: The smallest scale: an all-zero row (a padded row of a budget) quantizes to zeros, not NaN.
_TINY = 1e-12
#: Block scaling's block: 1 x BLOCK activation blocks, BLOCK x BLOCK weight blocks.
BLOCK = 128
#: Inputs at most this wide stay row-scaled (the module's docstring says why).
_ROW_SCALED_MAX_WIDTH = 1024
#: The block-scaled GEMM reads weight scales in groups of this many blocks of K, and rows in
#: multiples of this many (the module's docstring).
_GROUP = 4
#: Where cuBLASLt's block-scaled FP8 GEMM runs (and was measured): Hopper.
_BLOCK_SCALED_CAPABILITY = (9, 0)


def graph_device(example_inputs: Sequence[Any]) -> torch.device | None:
    """The device of a graph's first tensor input."""
    return next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), None)


def check_fp8_device(device: torch.device | None) -> None:
    """Raise :class:`InvalidOptionError` unless ``device`` is a GPU with FP8 tensor cores."""
    if device is None or device.type != "cuda":
        raise InvalidOptionError(
            f"quantization='fp8' needs a CUDA GPU with FP8 tensor cores (compute capability "
            f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer: Ada, Hopper, Blackwell); "
            f"this graph runs on {device}. Leave quantization=None here")
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < FP8_MIN_CAPABILITY:
        raise InvalidOptionError(
            f"quantization='fp8' needs FP8 tensor cores (compute capability "
            f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}. "
            "Leave quantization=None on this GPU")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ([M, K]) as e4m3 with one fp32 scale per row ([M, 1]): ``x ~= q * scale``."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=_TINY)
    scale = amax / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear weight ([N, K]) as e4m3 with one scale per output channel, as ``[1, N]``."""
    q, scale = quantize_rows(weight.detach())
    return q, scale.t().contiguous()


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ([M, K], K a multiple of :data:`BLOCK`) as e4m3 with one fp32 scale per block of
    ``BLOCK`` columns of a row: ``scale`` is [M, K / BLOCK], stored column by column (strides
    ``(1, M)``), the layout cuBLASLt reads."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp(min=_TINY)  # [M, K / BLOCK]
    scale = (amax / E4M3_MAX).t().contiguous().t()
    q = (blocks / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.reshape(m, k), scale


def quantize_weight_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear weight ([N, K], both multiples of :data:`BLOCK`) as e4m3 with one scale per
    ``BLOCK`` x ``BLOCK`` block, as ``[N / BLOCK, K / BLOCK]``."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=_TINY) / E4M3_MAX
    q = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.reshape(n, k), scale.reshape(n // BLOCK, k // BLOCK)


def scaling_for(weight_shape: Sequence[int], device: torch.device) -> str:
    """``"blocks"`` where a linear layer with this weight ([N, K]) runs block-scaled on
    ``device``, else ``"rows"`` (the module's docstring says where and why)."""
    n, k = weight_shape
    if (device.type != "cuda" or k <= _ROW_SCALED_MAX_WIDTH or n % BLOCK
            or k % (BLOCK * _GROUP)):
        return "rows"
    capability = tuple(torch.cuda.get_device_capability(device))
    return "blocks" if capability == _BLOCK_SCALED_CAPABILITY else "rows"


def fp8_linear(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``F.linear(x, W, bias)`` with ``W`` given as :func:`quantize_weight` returned it."""
    rows = x.reshape(-1, x.shape[-1])
    q, scale = quantize_rows(rows)
    out = _compat.scaled_mm_rowwise(q, weight_q.t(), scale, weight_scale,
                                    None if bias is None else bias.to(torch.bfloat16))
    return out.reshape(*x.shape[:-1], weight_q.shape[0]).to(out_dtype)


def _scaled_mm_blocks(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                      scale_b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.scaled_mm(a, b, scale_a, F.ScalingType.BlockWise1x128, scale_b,
                       F.ScalingType.BlockWise128x128, bias=bias, output_dtype=torch.bfloat16)


#: Inductor must hand the op its scales in the strides the GEMM checks.
_EXACT_STRIDES = getattr(torch.Tag, "needs_exact_strides", torch.Tag.needs_fixed_stride_order)


@torch.library.custom_op("vitgraph::fp8_block_scaled_mm", mutates_args=(),
                         schema="(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
                                "Tensor? bias) -> Tensor", tags=(_EXACT_STRIDES,))
def _block_scaled_mm_op(a, b, scale_a, scale_b, bias):
    m = a.shape[0]
    a, scale_a = _rows_padded(a, scale_a)
    return _scaled_mm_blocks(a, b, scale_a, scale_b, bias)[:m]


@_block_scaled_mm_op.register_fake
def _(a, b, scale_a, scale_b, bias):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16)


def _rows_padded(a: torch.Tensor, scale_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and its scales with zero rows (scale 1) up to a multiple of 4 rows, in the layouts
    :func:`block_scaled_mm` takes: copies, made only where the row count needs them."""
    m, k = a.shape
    rows = m + (-m) % _GROUP
    if rows == m:
        return a, scale_a
    padded = a.new_zeros((rows, k))
    padded[:m] = a
    scales = scale_a.new_ones((scale_a.shape[1], rows))
    scales[:, :m] = scale_a.t()
    return padded, scales.t()


def block_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                    scale_b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``a @ b + bias`` in bf16 for e4m3 ``a`` ([M, K] row-major) with one
    fp32 scale per 1x128 block (``scale_a`` [M, K/128], strides ``(1, M)``) and e4m3 ``b``
    ([K, N] column-major, K a multiple of 512) with one per 128x128 block (``scale_b``
    [K/128, N/128], strides ``(1, K/128)``): cuBLASLt's block-scaled GEMM, through PyTorch's
    public ``F.scaled_mm``, which checks these layouts. cuBLASLt takes only a multiple of 4
    rows: the op pads other row counts (copies of ``a`` and its scales) and returns the rows
    asked for.

    An op of its own (``vitgraph::fp8_block_scaled_mm``) so that Inductor passes the scales in
    these strides, and so that the padding stays out of the graph: padded there (before the
    quantization, sliced after the GEMM), the kernel after CLIP ViT-L/14-336's fc2 (residual
    add, LayerNorm, the next layer's row quantization) took 4.33 against 1.39 ms a call of 48
    images in a graph with a dynamic batch, more than the block scaling saved
    (``benchmarks/results/fp8_block_scaled_*``)."""
    return torch.ops.vitgraph.fp8_block_scaled_mm.default(a, b, scale_a, scale_b, bias)


def fp8_linear_blocks(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``F.linear(x, W, bias)`` block-scaled, with ``W`` given as :func:`quantize_weight_blocks`
    returned it."""
    q, scale = quantize_blocks(x.reshape(-1, x.shape[-1]))
    out = block_scaled_mm(q, weight_q.t(), scale, weight_scale.t(),
                          None if bias is None else bias.to(torch.bfloat16))
    return out.reshape(*x.shape[:-1], weight_q.shape[0]).to(out_dtype)


#: How each scaling quantizes a weight, and the op that runs the layer.
_SCALINGS: dict[str, tuple[Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                           Callable[..., torch.Tensor]]] = {
    "rows": (quantize_weight, fp8_linear),
    "blocks": (quantize_weight_blocks, fp8_linear_blocks),
}


@dataclass
class _Entry:
    index: int  # the weight's position among the graph's arguments
    q: torch.Tensor
    scale: torch.Tensor
    key: tuple[int, int | None]
    scaling: str = "rows"  # a key of _SCALINGS


def _key(weight: torch.Tensor) -> tuple[int, int | None]:
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor: no version counter
        version = None
    return weight.data_ptr(), version


class Fp8Weights:
    """The FP8 copies of one graph's weights, kept in step with the parameters."""

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.requantized = 0  # weights quantized again after the first time
        self._lock = threading.Lock()

    @property
    def block_scaled(self) -> int:
        """Layers that run block-scaled (:func:`scaling_for`); the others are row-scaled."""
        return sum(1 for e in self.entries if e.scaling == "blocks")

    @property
    def untracked(self) -> int:
        """Weights without a version counter (in-place writes to them are not seen)."""
        return sum(1 for e in self.entries if e.key[1] is None)

    def refresh(self, args: Sequence[Any]) -> int:
        """Quantize again every weight changed since it was last quantized; returns how many."""
        stale = []
        for entry in self.entries:
            weight = args[entry.index]
            key = _key(weight)
            if key != entry.key:
                stale.append((entry, weight, key))
        if not stale:
            return 0
        with self._lock, torch.no_grad():
            for entry, weight, key in stale:
                q, scale = _SCALINGS[entry.scaling][0](weight)
                entry.q.copy_(q)
                entry.scale.copy_(scale)
                entry.key = key
            self.requantized += len(stale)
        log.info("vitgraph: quantized %d changed weights to fp8 again", len(stale))
        return len(stale)


def quantize_linears(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
                     ) -> tuple[torch.fx.GraphModule, Fp8Weights]:
    """``gm`` with its eligible linear layers as :func:`fp8_linear`, and their FP8 weights.

    A layer is eligible when its weight is a parameter of two dimensions whose sizes are multiples
    of 16, and it returns a floating tensor. Others stay as they are (the count is logged).
    Weights are found as :func:`~vit_graph_backend.linear_rewrite.linear_layers` says.

    The result is a new ``GraphModule`` over the rewritten graph, holding the FP8 weights as
    buffers. It does not carry Dynamo's module metadata: AOTAutograd matches every buffer of a
    Dynamo module to a Dynamo source for its guards (``_param_name_to_source``), and these
    buffers have none; as a plain module, its buffers are simply inputs of the compiled code.
    """
    weights = Fp8Weights()
    kept = 0
    for node, (x, _, bias), source in linear_layers(gm):
        weight = None if source is None else example_inputs[source]
        out = _compat.example_value(node)
        if (not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2 or any(s % _ALIGN for s in weight.shape)
                or not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point):
            kept += 1
            continue
        scaling = scaling_for(weight.shape, weight.device)
        quantize, op = _SCALINGS[scaling]
        with torch.no_grad():
            q, scale = quantize(weight)
        name = f"_vitgraph_fp8_{len(weights.entries)}"
        gm.register_buffer(f"{name}_q", q)
        gm.register_buffer(f"{name}_scale", scale)
        weights.entries.append(_Entry(source, q, scale, _key(weight), scaling))
        with gm.graph.inserting_before(node):
            q_node = gm.graph.get_attr(f"{name}_q")
            scale_node = gm.graph.get_attr(f"{name}_scale")
            new = gm.graph.call_function(op, (x, q_node, scale_node, bias, out.dtype))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    rewritten = torch.fx.GraphModule(gm, gm.graph)  # generates its code from the graph
    log.info("vitgraph: quantization='fp8': %d linear layers as fp8 (%d of them block-scaled), "
             "%d kept (weights not parameters, or sides not multiples of %d)",
             len(weights.entries), weights.block_scaled, kept, _ALIGN)
    return rewritten, weights

