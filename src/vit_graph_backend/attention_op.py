"""``attention_kernel="timed"`` (opt-in): each attention of a ``torch.compile`` graph runs the
faster of PyTorch's SDPA and a Triton flash-attention kernel, timed per shape.

The batched ViTs (HF's CLIP, SigLIP, DINOv2 and ViT, timm's ViT) call
``F.scaled_dot_product_attention`` on ``[B, heads, tokens, head]`` views of their projections,
with no mask, no dropout and no causal mask. PyTorch's dispatch (cuDNN on an H100) was within
2 % of its fastest SDPA backend at every one of their shapes
(``benchmarks/results/sdpa_backends_per_vit_attention_shape_graph_timed_*``), but not of the
fastest kernel: the packed towers' Triton segment kernel (``adapters/_segment_attention_kernel``),
with the images as segments of one length, took 0.204 against 0.224 ms at CLIP ViT-L/14-336's
attention over 48 images, in 64-row blocks, and lost at 8 images, at ViT-B/16's, SigLIP's and
DINOv2-L's shapes (``benchmarks/results/segment_attention_kernel_vit_shapes_*``). Neither wins
everywhere, so the choice is measured.

:func:`rewrite_attention` replaces each such call of a traced graph whose q, k and v have one
shape and a 16-bit dtype with the op ``vitgraph::attention`` defined here (pure FX editing, tested
on CPU). The op times, per shape (device, dtype, batch, heads, tokens, head size), PyTorch's SDPA
against the Triton kernel in :data:`TRITON_CONFIGS` from CUDA-graph replays on the call's own
tensors (``gpu_timing.graph_ms``), the first time the shape runs outside a capture (the runtime's
warm-up before each capture is such a run), and runs the winner from then on; a shape first met
inside a capture runs SDPA there. The kernel takes q, k and v whose batch and token axes merge
into one row axis with heads within a row (``[B, tokens, heads, head]`` memory, the layout the
models' ``view(...).transpose(1, 2)`` leaves), 16-byte aligned; other layouts, CPUs, GPUs
without TMA (compute capability below 9.0) and a missing Triton run SDPA. The op's output always
has ``[B, tokens, heads, head]`` memory, as SDPA's CUDA backends give it, so the models'
``transpose(1, 2)`` and reshape after it stay views.

Why it is not the default: measured on an H100 with CLIP ViT-L/14-336
(``benchmarks/results/attention_kernel_timed_vs_sdpa_*``), the timing chose the Triton kernel
at 24 and 48 images and SDPA at 8; at 48 images the attention kernels took 5.39 against 5.76 ms
a call, but whole calls, interleaved in one process, came out 1.3 to 2.3 % faster, within the
1.4 % that two identical graphs differed by at 8 images. The timing itself costs a first pass
over the 3-to-48-image ladder 12.8 s with cold caches (the kernel is compiled for several batch
sizes) and 1.3 to 1.6 s with warm ones, whose whole first pass is 11 to 12 s (README).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .adapters._segment_attention import MAX_HEAD_DIM, MAX_SEGMENTS
from .fused_linear import MIN_CAPABILITY, tma_unavailable
from .gpu_timing import graph_ms, time_each

__all__ = ["CHOICES", "DTYPES", "TRITON_CONFIGS", "AttentionChoices", "attention",
           "attention_unavailable", "reads_rows", "rewrite_attention", "rows_view"]

log = logging.getLogger(__name__)

#: The dtypes the Triton kernel takes.
DTYPES = (torch.bfloat16, torch.float16)
#: (block of rows, block of keys, warps, pipeline stages) timed against SDPA: 64 rows won CLIP-L's
#: shape, 128 the packed towers' long segments (``segment_attention_kernel_vit_shapes_*``).
TRITON_CONFIGS: tuple[tuple[int, int, int, int], ...] = ((64, 64, 4, 3), (128, 64, 4, 3))
#: Programs the kernel's grid takes along its rows (its head size and segment slots are the
#: packed towers' limits: ``_segment_attention.MAX_HEAD_DIM``, ``MAX_SEGMENTS``).
MAX_GRID_Y = 65535
#: The fewest rows a program of :data:`TRITON_CONFIGS` takes: the most programs along the grid.
_SMALLEST_BLOCK = min(config[0] for config in TRITON_CONFIGS)
_SDPA = "sdpa"
#: Calls per timing graph and replays timed, as for ``fused_linear``'s choices.
_GRAPH_CALLS, _GRAPH_REPS = 3, 3
#: Shapes timed at most; past it new shapes run SDPA untimed.
MAX_TIMED_SHAPES = 1024

Choice = str | tuple[int, int, int, int]


def _output_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An empty ``[B, heads, tokens, v's head]`` tensor with ``[B, tokens, heads, head]`` memory."""
    batch, heads, tokens, _ = q.shape
    return q.new_empty((batch, tokens, heads, v.shape[-1])).transpose(1, 2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q, k, v, scale=scale)
    like = _output_like(q, v)
    if out.stride() == like.stride():
        return out
    return like.copy_(out)  # the math backend (CPU) returns [B, heads, tokens, head] memory


@torch.library.custom_op("vitgraph::attention", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, float? scale) -> Tensor")
def _attention_op(q, k, v, scale):
    return CHOICES.run(q, k, v, scale)


@_attention_op.register_fake
def _(q, k, v, scale):
    return _output_like(q, v)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              scale: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, scale=scale)`` through the op (what the graph
    rewrite calls): the faster of SDPA and the Triton kernel per shape where the kernel runs,
    SDPA elsewhere."""
    return torch.ops.vitgraph.attention.default(q, k, v, scale)


@functools.cache
def _kernel() -> tuple[Any, str | None]:
    """The Triton kernel's module, or why it does not import."""
    try:
        from .adapters import _segment_attention_kernel
        return _segment_attention_kernel, None
    except Exception as exc:  # Triton missing or too old for host tensor descriptors
        return None, f"the Triton kernel does not import ({type(exc).__name__}: {exc})"


def attention_unavailable(device: torch.device | None) -> str | None:
    """Why the Triton kernel cannot run on ``device`` (``None``: it can)."""
    return tma_unavailable(device) or _kernel()[1]


def reads_rows(x: torch.Tensor) -> bool:
    """Whether the kernel reads a ``[B, heads, tokens, head]`` tensor as ``(B * tokens, heads,
    head)`` rows: its batch and token axes merge, its heads lie within a row, and its rows and
    heads are 16-byte aligned. Also on the traced values of the rewrite, whose batch (and only
    it) may be a symbol: symbolic strides are not read."""
    batch, _, tokens, _ = x.shape
    strides = x.stride()
    if not all(isinstance(s, int) for s in strides):
        return False
    s_batch, s_head, s_token, s_col = strides
    size = x.element_size()
    if s_col != 1 or (s_token * size) % 16 or (s_head * size) % 16:
        return False
    return str(batch) == "1" or (isinstance(tokens, int) and s_batch == tokens * s_token)


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` (:func:`reads_rows`) as the kernel's ``(B * tokens, heads, head)`` view."""
    batch, heads, tokens, head = x.shape
    return x.transpose(1, 2).view(batch * tokens, heads, head)


class AttentionChoices:
    """Which kernel each shape runs, timed once per shape (thread-safe; one per process)."""

    def __init__(self) -> None:
        #: (device index, dtype, batch, heads, tokens, head) -> ``"sdpa"`` or a Triton config
        self.chosen: dict[tuple[Any, ...], Choice] = {}
        #: Triton config -> why it failed to compile or run (not tried again)
        self.refused: dict[tuple[int, int, int, int], str] = {}
        #: (device index, batch, tokens) -> the int32 segment offsets the kernel reads (made
        #: outside captures and kept: a graph captured with them reads them by address)
        self._offsets: dict[tuple[int, int, int], torch.Tensor] = {}
        self._lock = threading.Lock()

    @property
    def state(self) -> dict[str, Any]:
        """Shapes timed and what won each, and refused configurations with their reasons."""
        with self._lock:
            return {"chosen": {_describe(k): _name(v) for k, v in self.chosen.items()},
                    "refused": {_name(c): why for c, why in self.refused.items()}}

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            scale: float | None) -> torch.Tensor:
        if not self._servable(q, k, v):
            return _sdpa(q, k, v, scale)
        key = (q.device.index, q.dtype, *q.shape)
        with torch.cuda.device(q.device):  # Triton launches on the current device
            with self._lock:
                choice = self.chosen.get(key)
                if (choice is None and len(self.chosen) < MAX_TIMED_SHAPES
                        and not torch.cuda.is_current_stream_capturing()):
                    choice = self.chosen[key] = self._time(q, k, v, scale)
            return self._launch(_SDPA if choice is None else choice, q, k, v, scale)

    @staticmethod
    def _servable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        if not (q.is_cuda and q.dim() == 4 and q.dtype in DTYPES and q.shape == k.shape == v.shape
                and k.dtype == v.dtype == q.dtype and k.device == v.device == q.device):
            return False
        batch, heads, tokens, head = q.shape
        return (0 < batch <= MAX_SEGMENTS and tokens > 0 and heads > 0 and head % 8 == 0
                and head <= MAX_HEAD_DIM
                and -(-batch * tokens // _SMALLEST_BLOCK) + batch <= MAX_GRID_Y
                and all(x.data_ptr() % 16 == 0 and reads_rows(x) for x in (q, k, v))
                and _kernel()[0] is not None
                and tuple(torch.cuda.get_device_capability(q.device)) >= MIN_CAPABILITY)

    def _segments(self, q: torch.Tensor) -> torch.Tensor:
        batch, _, tokens, _ = q.shape
        key = (q.device.index, batch, tokens)
        offsets = self._offsets.get(key)
        if offsets is None:  # the first stored is kept: a graph may read it
            offsets = self._offsets.setdefault(key, torch.arange(
                0, batch * tokens + 1, tokens, dtype=torch.int32, device=q.device))
        return offsets

    def _launch(self, choice: Choice, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float | None) -> torch.Tensor:
        if choice == _SDPA:
            return _sdpa(q, k, v, scale)
        batch, heads, tokens, head = q.shape
        block_m, block_n, warps, stages = choice
        out = _kernel()[0].attend(*map(rows_view, (q, k, v)), self._segments(q),
                                  _scale(q, scale), block_m, block_n, warps, stages)
        return out.view(batch, tokens, heads, head).transpose(1, 2)

    def _time(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              scale: float | None) -> Choice:
        """The fastest kernel for this shape, each timed from CUDA-graph replays on the call's
        own tensors (the first run outside the timing graph compiles a Triton config)."""
        offsets = self._segments(q)  # outside every capture, and kept
        configs = [c for c in TRITON_CONFIGS if c not in self.refused]
        kernel = _kernel()[0]
        if kernel is not None and q.is_cuda:  # cold caches: the compiles side by side
            kernel.precompile(*map(rows_view, (q, k, v)), offsets, _scale(q, scale), configs)
        times, failures = time_each(
            (_SDPA, *configs),
            lambda choice: self._launch(choice, q, k, v, scale), calls=_GRAPH_CALLS,
            reps=_GRAPH_REPS, timer=graph_ms)
        short = [reason for reason, memory in failures.values() if memory]
        if short:  # the moment's memory, not the kernels: refused for no other shape
            log.warning("vitgraph: attention at %s: %d kernels not timed, %s", tuple(q.shape),
                        len(short), short[0])
        for choice, (reason, memory) in failures.items():
            if memory:
                continue
            if choice == _SDPA:
                log.warning("vitgraph: attention at %s: SDPA not timed (%s)", tuple(q.shape),
                            reason)
            else:
                self.refused[choice] = reason  # type: ignore[index]
                log.warning("vitgraph: Triton attention %s refused (%s); not tried again",
                            _name(choice), reason)
        best = min(times, key=times.__getitem__) if times else _SDPA
        log.debug("vitgraph: attention at %s: %s (%s)", tuple(q.shape), _name(best),
                  ", ".join(f"{_name(c)} {ms:.4f} ms" for c, ms in times.items()))
        return best


def _scale(q: torch.Tensor, scale: float | None) -> float:
    """SDPA's scale: ``scale``, else one over the root of the head size."""
    return q.shape[-1] ** -0.5 if scale is None else scale


def _name(choice: Choice) -> str:
    """``"sdpa"`` or ``"triton "`` and the config's fields."""
    return choice if isinstance(choice, str) else "triton " + "x".join(map(str, choice))


def _describe(key: tuple[Any, ...]) -> str:
    index, dtype, batch, heads, tokens, head = key
    return (f"cuda:{index} {str(dtype).removeprefix('torch.')} {batch} x {heads} heads x "
            f"{tokens} tokens x {head}")


#: The process's choices (shapes are the same whichever graph meets them).
CHOICES = AttentionChoices()

#: ``F.scaled_dot_product_attention``'s parameters, in order.
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                  "enable_gqa": False}


def rewrite_attention(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Rewrite, in place, every ``F.scaled_dot_product_attention`` of ``gm`` without a mask,
    dropout, causal mask or grouped heads, whose q, k and v are 4-D of one shape and one 16-bit
    dtype in a layout the kernel reads (:func:`reads_rows`), into ``vitgraph::attention``;
    returns how many. ``example_inputs`` is the backends' signature; the tensors' traced values
    (``meta["example_value"]``) say the rest."""
    del example_inputs
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not F.scaled_dot_product_attention:
            continue
        args = {name: node.args[i] if i < len(node.args) else
                node.kwargs.get(name, _SDPA_DEFAULTS.get(name))
                for i, name in enumerate(_SDPA_PARAMS)}
        if (args["attn_mask"] is not None or args["dropout_p"] not in (0, 0.0)
                or args["is_causal"] is not False or args["enable_gqa"] is not False
                or not (args["scale"] is None or isinstance(args["scale"], float))
                or not _kernel_layout([args[n] for n in ("query", "key", "value")])):
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.vitgraph.attention.default,
                                         (args["query"], args["key"], args["value"],
                                          args["scale"]))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _kernel_layout(nodes: list[Any]) -> bool:
    values = [n.meta.get("example_value") if isinstance(n, torch.fx.Node) else None
              for n in nodes]
    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in values):
        return False
    shapes = {tuple(map(str, x.shape)) for x in values}
    return (len(shapes) == 1 and len({x.dtype for x in values}) == 1
            and values[0].dtype in DTYPES and all(map(reads_rows, values)))
