"""The graph rewrites' walk over linear layers, and ``epilogue_fusion``'s rewrite of a linear
layer and its GELU into ``fused_linear``'s op ``vitgraph::linear_act``. Pure FX graph editing,
tested on CPU.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .. import _compat
from ..kernels.fused_linear import DTYPES

__all__ = ["fuse_linear_activations", "linear_layers"]


def linear_layers(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, list[Any]]]:
    """Each ``F.linear`` node of ``gm`` with its ``[input, weight, bias]``."""
    layers = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is F.linear:
            layers.append((node, [node.args[i] if i < len(node.args) else node.kwargs.get(name)
                                  for i, name in enumerate(("input", "weight", "bias"))]))
    return layers


def fuse_linear_activations(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
    rewritten: Callable[[torch.Tensor, torch.Tensor | None, str], None] | None = None,
) -> int:
    """Rewrite, in place, every ``act(F.linear(x, W, b))`` of ``gm`` whose weight is a 2-D
    bf16/fp16 graph input with both sides multiples of 8 into ``vitgraph::linear_act``; returns
    how many run a call. ``rewritten(weight, bias, activation)`` is called for each rewritten
    layer whose bias is a graph input or absent (the backend starts kernel builds there).

    A layer inside a nested compile region (``torch.compiler.nested_compile_region``) is one
    graph for every call of the region: it is rewritten once, reading each operand from the
    first call that passes a graph input there (Dynamo traces another graph for operands of
    other shapes or dtypes), and counted once a call."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    return _fuse(gm, dict(zip(placeholders, example_inputs, strict=False)), rewritten, {})


def _fuse(gm: torch.fx.GraphModule, inputs: dict[torch.fx.Node, Any],
          rewritten: Callable[[torch.Tensor, torch.Tensor | None, str], None] | None,
          per_call: dict[int, int]) -> int:
    """:func:`fuse_linear_activations` on ``gm``, whose placeholders hold ``inputs``;
    ``per_call``: the count of each region graph already rewritten (one graph may be called
    under several names, from ``gm`` and from inside other regions)."""
    fused = 0
    for node, (x, weight_node, bias) in linear_layers(gm):
        weight = inputs.get(weight_node)
        if (not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype not in DTYPES
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
        bias_tensor = None if bias is None else inputs.get(bias)
        if rewritten is not None and (bias is None or isinstance(bias_tensor, torch.Tensor)):
            rewritten(weight, bias_tensor, activation)
    if fused:
        gm.graph.lint()
        gm.recompile()
    regions: dict[int, tuple[torch.fx.GraphModule, list[torch.fx.Node]]] = {}
    for target, calls in _compat.nested_region_calls(gm).items():
        region = gm.get_submodule(target)
        regions.setdefault(id(region), (region, []))[1].extend(calls)
    for key, (region, calls) in regions.items():
        if key not in per_call:
            placeholders = region.graph.find_nodes(op="placeholder")
            operands = [_first_input(inputs, calls, 2 + i) for i in range(len(placeholders))]
            per_call[key] = _fuse(region, dict(zip(placeholders, operands)), rewritten, per_call)
        fused += len(calls) * per_call[key]
    return fused


def _first_input(inputs: dict[torch.fx.Node, Any], calls: list[torch.fx.Node], at: int) -> Any:
    """The first graph input any of ``calls`` passes as argument ``at`` (``None``: none does)."""
    for call in calls:
        arg = call.args[at] if at < len(call.args) else None
        if isinstance(arg, torch.fx.Node) and isinstance(inputs.get(arg), torch.Tensor):
            return inputs[arg]
    return None


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
