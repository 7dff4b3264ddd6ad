"""``quantization="fp8"``: the linear layers of a compiled graph as FP8 (e4m3) GEMMs.

:func:`quantize_linears` rewrites a Dynamo graph before the inner compiler sees it. Each
``F.linear`` whose weight is a parameter (2-D, both sides multiples of 16, as cuBLASLt's FP8
kernels need) becomes :func:`fp8_linear`:

- the weight is quantized **once**, per output channel (one fp32 scale per row of ``W``), into
  buffers the graph reads (the user's parameter is not touched);
- the activation is quantized **per row at run time** (one scale per token), inside the graph;
- the GEMM is cuBLASLt's row-wise scaled FP8 matmul with the bias in its epilogue, output bf16,
  cast back to what the original layer returned.

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

:func:`fp8_linear` stays a plain function in the graph, so Inductor fuses its quantization with
the ops around it; AOTAutograd's compile cache takes such a graph only for a function it is told
it may (``_compat.mark_cacheable``, keyed by this module's and ``_compat``'s code), or every
process would trace the model again (tested on CPU in ``tests/unit/test_fp8_linear.py``).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import _compat
from .errors import InvalidOptionError
from .linear_rewrite import linear_layers

__all__ = ["E4M3_MAX", "FP8_MIN_CAPABILITY", "Fp8Weights", "check_fp8_device", "fp8_linear",
           "graph_device", "quantize_linears", "quantize_rows", "quantize_weight"]

#: The key of :func:`fp8_linear` in the compile caches (``_compat.mark_cacheable``): AOTAutograd
#: cannot see into a plain function, so a cached trace must not outlive a change to its code.
_CACHE_KEY = hashlib.sha256(Path(__file__).read_bytes()
                            + Path(_compat.__file__).read_bytes()).hexdigest()

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)
#: FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer.
FP8_MIN_CAPABILITY = (8, 9)
#: cuBLASLt's FP8 GEMMs need both matrix sides in multiples of 16.
_ALIGN = 16
#: The smallest scale: an all-zero row (a padded row of a budget) quantizes to zeros, not NaN.
_TINY = 1e-12


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


def fp8_linear(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``F.linear(x, W, bias)`` with ``W`` given as :func:`quantize_weight` returned it."""
    rows = x.reshape(-1, x.shape[-1])
    q, scale = quantize_rows(rows)
    out = _compat.scaled_mm_rowwise(q, weight_q.t(), scale, weight_scale,
                                    None if bias is None else bias.to(torch.bfloat16))
    return out.reshape(*x.shape[:-1], weight_q.shape[0]).to(out_dtype)


@dataclass
class _Entry:
    index: int  # the weight's position among the graph's arguments
    q: torch.Tensor
    scale: torch.Tensor
    key: tuple[int, int | None]


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
                q, scale = quantize_weight(weight)
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
    # what fp8_linear computes is this module's and _compat's code: their bytes key the caches
    _compat.mark_cacheable(fp8_linear, _CACHE_KEY)
    weights = Fp8Weights()
    kept = 0
    for node, (x, _, bias), source in linear_layers(gm):
        weight = None if source is None else example_inputs[source]
        out = _compat.example_value(node)
        if (not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2 or any(s % _ALIGN for s in weight.shape)
                or not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point):
            kept += 1
            continue
        with torch.no_grad():
            q, scale = quantize_weight(weight)
        name = f"_vitgraph_fp8_{len(weights.entries)}"
        gm.register_buffer(f"{name}_q", q)
        gm.register_buffer(f"{name}_scale", scale)
        weights.entries.append(_Entry(source, q, scale, _key(weight)))
        with gm.graph.inserting_before(node):
            q_node = gm.graph.get_attr(f"{name}_q")
            scale_node = gm.graph.get_attr(f"{name}_scale")
            new = gm.graph.call_function(fp8_linear, (x, q_node, scale_node, bias, out.dtype))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    rewritten = torch.fx.GraphModule(gm, gm.graph)  # generates its code from the graph
    log.info("vitgraph: quantization='fp8': %d linear layers as fp8, %d kept (weights not "
             "parameters, or sides not multiples of %d)", len(weights.entries), kept, _ALIGN)
    return rewritten, weights

