"""``epilogue_fusion="auto"``: a linear layer and its GELU as one GEMM where that is faster.

Inductor runs ``act(F.linear(x, W, b))`` as a cuBLAS GEMM and a separate pointwise kernel that
reads and writes the whole intermediate again; its own Triton GEMM templates, which could take the
activation into their epilogue, lost to cuBLAS at every MLP shape of CLIP ViT-L/14-336
(``benchmarks/results/clip_l14_336_fixed_batch_inductor_gemm_autotune_*``), so it never fuses.
:func:`fuse_linear_activations` rewrites the traced graph before the inner compiler sees it: each
``F.linear`` whose only consumer is an activation this module knows (HF's quick GELU
``y * sigmoid(1.702 y)``, exact GELU, tanh GELU) becomes one call of the custom op
``vitgraph::linear_act``.

The op picks, per shape, between a Triton GEMM with bias and activation in its epilogue (two tile
configurations, ``_linear_act_kernels.py``) and cuBLAS followed by an in-place activation kernel,
by timing them on the call's own tensors the first time the shape runs outside a CUDA graph
capture (the runtime's warm-up runs before each capture are such runs); a shape first met inside
a capture takes cuBLAS + activation and is timed at its next run outside one. The fused kernel
wins on the large GPU-bound shapes (CLIP-L fc1 at 48 images: 0.38 against 0.49 ms) and cuBLAS on
small ones (ViT-B fc1 at 8 images); ``benchmarks/results/linear_act_probe_*`` has the table.

Where the fused path cannot run (no CUDA, a GPU older than Hopper's tensor memory accelerator, no
Triton, an operand the kernel's descriptors cannot address), the op computes the same thing with
PyTorch's ops, so a rewritten graph is correct on any device.
"""

from __future__ import annotations

import functools
import logging
import operator
import statistics
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "CHOICES", "LinearActChoices", "activation_of", "activation_reference",
           "fuse_linear_activations", "fused_epilogue_unavailable", "linear_act",
           "linear_act_reference", "linear_layers"]

log = logging.getLogger(__name__)

#: The activations the op takes (``_linear_act_kernels.ACTIVATIONS`` codes them for the kernels).
ACTIVATIONS: tuple[str, ...] = ("quick_gelu", "gelu", "gelu_tanh")
#: Fused tile configurations timed per shape (``_linear_act_kernels.CONFIGS`` says the fields).
#: 128x256 won every large shape of the probe, 128x128 the small ones
#: (``benchmarks/linear_act_probe.py``).
FUSED_CONFIGS: tuple[tuple[int, ...], ...] = ((128, 256, 64, 3, 8, 0, 1),
                                              (128, 256, 64, 4, 8, 0, 1),
                                              (128, 128, 64, 4, 8, 0, 1))
#: The tensor memory accelerator the kernel loads through: Hopper (9.0) and newer.
MIN_CAPABILITY = (9, 0)
_DTYPES = (torch.bfloat16, torch.float16)
_UNFUSED = "cublas+activation"
_PYTORCH = "pytorch"  # what runs when neither Triton path does for a shape
_TIMED_RUNS = 5
#: Shapes timed at most: past this (an eager fallback meeting a new row count at every call,
#: say), new shapes take cuBLAS + activation untimed, so no call keeps paying for timing.
MAX_TIMED_SHAPES = 1024


def activation_reference(y: torch.Tensor, activation: str) -> torch.Tensor:
    """One of :data:`ACTIVATIONS` in PyTorch's ops."""
    if activation == "quick_gelu":
        return y * torch.sigmoid(1.702 * y)
    return F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")


def linear_act_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         activation: str) -> torch.Tensor:
    """What the rewritten nodes computed, in PyTorch's ops."""
    return activation_reference(F.linear(x, weight, bias), activation)


def activation_of(module: Any) -> str | None:
    """Which of :data:`ACTIVATIONS` a callable computes (``None``: none of them), judged by its
    values on a float64 probe against :func:`activation_reference`, so any class that computes
    one (HF's ``QuickGELUActivation``, ``GELUTanh``, ``nn.GELU``...) counts."""
    probe = torch.linspace(-8.0, 8.0, 257, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = module(probe)
    except Exception:  # not an elementwise function of one tensor
        return None
    if not isinstance(got, torch.Tensor) or got.shape != probe.shape:
        return None
    return next((name for name in ACTIVATIONS
                 if torch.allclose(got, activation_reference(probe, name), rtol=1e-9,
                                   atol=1e-12)), None)


@torch.library.custom_op("vitgraph::linear_act", mutates_args=(),
                         schema="(Tensor x, Tensor weight, Tensor? bias, str activation) -> Tensor")
def _linear_act_op(x, weight, bias, activation):
    return CHOICES.run(x, weight, bias, activation)


@_linear_act_op.register_fake
def _(x, weight, bias, activation):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               activation: str) -> torch.Tensor:
    """``act(F.linear(x, weight, bias))`` through the op (what the graph rewrite calls; packed
    adapters call it directly): the faster of the fused kernel and cuBLAS + activation per shape
    on a Hopper GPU, PyTorch's ops elsewhere."""
    return torch.ops.vitgraph.linear_act.default(x, weight, bias, activation)


def fused_epilogue_unavailable(device: torch.device | None) -> str | None:
    """Why the fused kernel cannot run on ``device`` (``None``: it can)."""
    if device is None or device.type != "cuda":
        return f"the graph runs on {device}, not a CUDA GPU"
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} has compute capability "
                f"{capability[0]}.{capability[1]}; the kernel needs {MIN_CAPABILITY[0]}."
                f"{MIN_CAPABILITY[1]} (Hopper's tensor memory accelerator) or newer")
    return _kernels()[1]


@functools.cache
def _kernels() -> tuple[Any, str | None]:
    """The Triton kernels module, or why it does not import."""
    try:
        from . import _linear_act_kernels
        return _linear_act_kernels, None
    except Exception as exc:  # Triton missing or too old for host tensor descriptors
        return None, f"Triton's kernels do not import ({type(exc).__name__}: {exc})"


class LinearActChoices:
    """Which way each shape runs, timed once per shape (thread-safe; one per process)."""

    def __init__(self) -> None:
        #: (device index, dtype, rows, K, N, activation, has bias) -> "cublas+activation" or
        #: "fused " and the tile configuration's fields joined by "x" (``CONFIGS``' order)
        self.chosen: dict[tuple[Any, ...], str] = {}
        #: fused configuration -> why it failed to compile or run (not tried again)
        self.refused: dict[tuple[int, ...], str] = {}
        self._lock = threading.Lock()

    @property
    def state(self) -> dict[str, Any]:
        """Shapes timed and what won each, and refused configurations with their reasons."""
        with self._lock:
            return {"chosen": {_describe(k): v for k, v in self.chosen.items()},
                    "refused": {"x".join(map(str, c)): why for c, why in self.refused.items()}}

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            activation: str) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if not self._fusable(rows, weight, bias):
            return linear_act_reference(x, weight, bias, activation)
        key = (x.device.index, x.dtype, *rows.shape, weight.shape[0], activation,
               bias is not None)
        with self._lock, torch.cuda.device(x.device):
            choice = self.chosen.get(key)
            if (choice is None and len(self.chosen) < MAX_TIMED_SHAPES
                    and not torch.cuda.is_current_stream_capturing()):
                choice = self.chosen[key] = self._time(rows, weight, bias, activation)
        with torch.cuda.device(x.device):  # Triton launches on the current device
            out = self._launch(choice or _UNFUSED, rows, weight, bias, activation)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def _fusable(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        # the descriptors need 16-byte aligned bases and row strides
        return (rows.is_cuda and rows.dtype in _DTYPES and weight.dtype == rows.dtype
                and rows.is_contiguous() and weight.is_contiguous() and rows.shape[0] > 0
                and rows.shape[1] % 8 == 0 and weight.shape[0] % 8 == 0
                and rows.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
                and (bias is None or bias.is_contiguous())
                and _kernels()[0] is not None
                and tuple(torch.cuda.get_device_capability(rows.device)) >= MIN_CAPABILITY)

    def _launch(self, choice: str, rows: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, activation: str) -> torch.Tensor:
        kernels = _kernels()[0]
        if choice == _PYTORCH:
            return linear_act_reference(rows, weight, bias, activation)
        if choice == _UNFUSED:
            return kernels.activation_(F.linear(rows, weight, bias), activation)
        config = tuple(int(v) for v in choice.split()[1].split("x"))
        return kernels.linear_act(rows, weight, bias, activation, config)

    def _time(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              activation: str) -> str:
        """The fastest way for this shape (median of CUDA-event timed runs on the current
        stream); each candidate also runs once before, which compiles its kernel."""
        candidates = [_UNFUSED] + [f"fused {'x'.join(map(str, c))}" for c in FUSED_CONFIGS
                                   if c not in self.refused]
        times = {}
        for choice in candidates:
            try:
                self._launch(choice, rows, weight, bias, activation)
                times[choice] = _median_ms(
                    lambda choice=choice: self._launch(choice, rows, weight, bias, activation))
            except Exception as exc:  # a kernel this GPU or Triton cannot build
                reason = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
                if choice == _UNFUSED:
                    log.warning("vitgraph: the activation kernel after cuBLAS failed at %d x %d "
                                "-> %d (%s)", *rows.shape, weight.shape[0], reason)
                    continue
                config = tuple(int(v) for v in choice.split()[1].split("x"))
                self.refused[config] = reason
                log.warning("vitgraph: fused linear+activation tile %s refused (%s); not tried "
                            "again", choice.split()[1], reason)
        if not times:
            return _PYTORCH
        best = min(times, key=times.__getitem__)
        log.debug("vitgraph: linear+%s at %d x %d -> %d: %s (%s)", activation, *rows.shape,
                  weight.shape[0], best, ", ".join(f"{k} {v:.4f} ms" for k, v in times.items()))
        return best


def _median_ms(fn: Any) -> float:
    stream = torch.cuda.current_stream()
    times = []
    for _ in range(_TIMED_RUNS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _describe(key: tuple[Any, ...]) -> str:
    index, dtype, m, k, n, activation, has_bias = key
    return (f"cuda:{index} {str(dtype).removeprefix('torch.')} {m}x{k} -> {n} {activation}"
            f"{' +bias' if has_bias else ''}")


#: The process's choices (shapes are the same whichever graph meets them).
CHOICES = LinearActChoices()


def linear_layers(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, list[Any], int | None]]:
    """Each ``F.linear`` node of ``gm`` (a list: the caller may rewrite the graph) with its
    ``[input, weight, bias]`` (given by position or name) and the weight's position among the
    graph's inputs (``None`` when the weight is not an input). Dynamo hands module parameters to
    backends as graph inputs (placeholders) on every supported torch, so that is where the graph
    rewrites (this module's and ``fp8_linear.py``'s) look for weights."""
    index = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    layers = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is F.linear:
            args = [node.args[i] if i < len(node.args) else node.kwargs.get(name)
                    for i, name in enumerate(("input", "weight", "bias"))]
            layers.append((node, args, index.get(args[1])))
    return layers


def fuse_linear_activations(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Rewrite, in place, every ``act(F.linear(x, W, b))`` of ``gm`` whose weight is a 2-D
    bf16/fp16 graph input with both sides multiples of 8 into ``vitgraph::linear_act``; returns
    how many (weights found as :func:`linear_layers` says)."""
    fused = 0
    for node, (x, weight_node, bias), source in linear_layers(gm):
        weight = None if source is None else example_inputs[source]
        if (not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype not in _DTYPES
                or any(s % 8 for s in weight.shape)):
            continue
        match = _activation_after(node)
        if match is None:
            continue
        activation, chain = match
        with gm.graph.inserting_before(chain[-1]):
            new = gm.graph.call_function(torch.ops.vitgraph.linear_act.default,
                                         (x, weight_node, bias, activation))
        new.meta.update(chain[-1].meta)
        chain[-1].replace_all_uses_with(new)
        for dead in reversed((node, *chain)):  # users before what they read
            gm.graph.erase_node(dead)
        fused += 1
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused


def _activation_after(linear: torch.fx.Node) -> tuple[str, list[torch.fx.Node]] | None:
    """``(activation, its nodes in order)`` when ``linear``'s users are one activation whose
    inner nodes nothing else reads."""
    users = list(linear.users)
    if len(users) == 1 and _is_call(users[0], F.gelu, "gelu") and users[0].args[0] is linear:
        gelu = users[0]
        approximate = gelu.kwargs.get("approximate", gelu.args[1] if len(gelu.args) > 1 else "none")
        if approximate in ("none", "tanh"):
            return ("gelu" if approximate == "none" else "gelu_tanh"), [gelu]
    if len(users) != 2:  # quick GELU: y * sigmoid(1.702 * y)
        return None
    scaled = next((u for u in users if _is_mul(u) and _other(u, linear) == 1.702), None)
    if scaled is None or len(scaled.users) != 1:
        return None
    sig = next(iter(scaled.users))
    if (not _is_call(sig, torch.sigmoid, "sigmoid") or sig.args[0] is not scaled
            or len(sig.users) != 1):
        return None
    last = next(iter(sig.users))
    if last in users and _is_mul(last) and _other(last, linear) is sig:
        return "quick_gelu", [scaled, sig, last]
    return None


def _is_call(node: torch.fx.Node, fn: Any, method: str) -> bool:
    return ((node.op == "call_function" and node.target is fn)
            or (node.op == "call_method" and node.target == method))


def _is_mul(node: torch.fx.Node) -> bool:
    return ((node.op == "call_function" and node.target in (operator.mul, torch.mul))
            or (node.op == "call_method" and node.target == "mul"))


def _other(node: torch.fx.Node, value: torch.fx.Node) -> Any:
    """The operand of a two-operand node that is not ``value`` (``None`` if neither is)."""
    a, b = (list(node.args) + [None, None])[:2]
    return b if a is value else a if b is value else None

