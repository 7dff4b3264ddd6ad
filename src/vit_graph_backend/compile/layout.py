"""What a Dynamo graph of a batched encoder looks like to the backend: :func:`analyze_graph`.

Reads the graph's fake metadata once, at compile time: which inputs carry the batch axis at dim 0,
which ints are the batch symbol or another symbol (the graph-set key), which tensors are module
state, and why graphs cannot serve the graph (training-mode ops, in-place input writes, outputs
that may mix rows), if they cannot.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from .. import _compat

__all__ = ["GraphLayout", "analyze_graph", "returns_nothing"]

_TRAINING_OPS = {
    torch.nn.functional.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
    torch.nn.functional.dropout3d, torch.nn.functional.alpha_dropout,
    torch.nn.functional.feature_alpha_dropout, torch.nn.functional.batch_norm,
    torch.dropout, torch.batch_norm,
}


class GraphLayout:
    """What :func:`analyze_graph` learned about a Dynamo graph."""

    def __init__(self) -> None:
        self.batch_symbol: str | None = None
        self.batch_tensors: list[int] = []   # arg positions with dim 0 == batch symbol
        self.batch_ints: list[int] = []      # arg positions of the batch symbol's int
        self.key_ints: list[int] = []        # arg positions of other symbols' ints
        self.state: list[int] = []           # other tensor args (module state, fixed inputs)
        self.params: set[int] = set()        # of those, nn.Parameter instances
        self.unsupported: str | None = None
        self.pinned = False  # a batch of 1 whose outputs lost the batch symbol: exact shapes only


def analyze_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> GraphLayout:
    """Find the batch axis, the graph-set key and module state; or why graphs cannot serve it."""
    layout = GraphLayout()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fakes = [_compat.example_value(n) for n in placeholders]
    if len(fakes) != len(example_inputs) or any(f is None for f in fakes):
        layout.unsupported = "graph inputs carry no fake metadata"
        return layout
    for fake, real in zip(fakes, example_inputs):
        if isinstance(fake, torch.Tensor) and fake.dim() > 0 and layout.batch_symbol is None:
            if not isinstance(real, torch.nn.Parameter):
                layout.batch_symbol = _compat.sym_name(fake.shape[0])
    for i, (fake, real) in enumerate(zip(fakes, example_inputs)):
        if isinstance(fake, torch.Tensor):
            if isinstance(real, torch.nn.Parameter):
                layout.params.add(i)
            if (layout.batch_symbol is not None and fake.dim() > 0
                    and _compat.sym_name(fake.shape[0]) == layout.batch_symbol):
                layout.batch_tensors.append(i)
            else:
                layout.state.append(i)
            other_dims = list(fake.shape[1:]) if i in layout.batch_tensors else list(fake.shape)
            if layout.batch_symbol and any(_mentions(d, layout.batch_symbol) for d in other_dims):
                layout.unsupported = f"input {i} carries the batch axis outside dim 0"
        elif isinstance(fake, torch.SymInt):
            name = _compat.sym_name(fake)
            if name is not None and name == layout.batch_symbol:
                layout.batch_ints.append(i)
            else:
                layout.key_ints.append(i)
        elif fake is not None and not isinstance(fake, (int, float, bool)):
            layout.unsupported = f"input {i} of type {type(fake).__name__} is not supported"
    layout.unsupported = layout.unsupported or _unsafe_ops(gm)
    outputs = None if layout.unsupported else _check_outputs(gm, layout)
    if outputs and layout.batch_tensors and example_inputs[layout.batch_tensors[0]].shape[0] == 1:
        # a batch-1 recompile whose outputs carry a concrete 1: served as a static graph
        layout.pinned = True
        layout.batch_symbol = None
        layout.batch_tensors, layout.batch_ints, layout.key_ints = [], [], []
    else:
        layout.unsupported = layout.unsupported or outputs
    return layout


def returns_nothing(gm: torch.fx.GraphModule) -> bool:
    """True for a graph with no outputs (nothing to serve from graphs)."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    return out_node.args[0] in ((), [])


def _mentions(dim: Any, symbol: str) -> bool:
    return isinstance(dim, torch.SymInt) and re.search(rf"\b{symbol}\b", str(dim)) is not None


def _unsafe_ops(gm: torch.fx.GraphModule) -> str | None:
    placeholders = {n for n in gm.graph.nodes if n.op == "placeholder"}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _TRAINING_OPS:
            training = node.kwargs.get("training")
            if training is None:
                training = any(a is True for a in node.args[1:])
            if training:
                return (f"training-mode op {getattr(node.target, '__name__', node.target)} in the "
                        "graph (call model.eval() for inference)")
        if node.op in ("call_method", "call_function") and node.args:
            name = node.target if isinstance(node.target, str) else getattr(
                node.target, "__name__", "")
            inplace = (name.endswith("_") and not name.endswith("__")) or name == "setitem"
            if inplace and node.args[0] in placeholders:
                return f"in-place write to graph input {node.args[0].name} ({name})"
    return None


def _check_outputs(gm: torch.fx.GraphModule, layout: GraphLayout) -> str | None:
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = out_node.args[0]
    if not isinstance(outs, (tuple, list)):
        return "graph output is not a tuple"
    if not outs:
        return "the graph returns no tensors"
    for k, node in enumerate(outs):
        fake = _compat.example_value(node) if isinstance(node, torch.fx.Node) else node
        if not isinstance(fake, torch.Tensor):
            return f"output {k} is a {type(fake).__name__}, not a tensor"
        if layout.batch_symbol is None:
            continue
        if fake.dim() == 0 or _compat.sym_name(fake.shape[0]) != layout.batch_symbol:
            return (f"output {k} of shape {tuple(fake.shape)} does not carry the batch axis at "
                    "dim 0 (it may mix rows, which padding would change)")
        if any(_mentions(d, layout.batch_symbol) for d in fake.shape[1:]):
            return f"output {k} carries the batch axis outside dim 0"
    return None
