"""Batched encoders under ``torch.compile``: one Dynamo graph, padded along its item axis.

A batched encoder (``[B, C, H, W]`` in: timm, torchvision, HF ViT/CLIP/SigLIP/DINOv2) needs no model
code. Dynamo hands the backend an FX graph; after its first recompile the batch dimension is a
symbol (``s77``). This module reads the graph's fake metadata once, at compile time:

- **batch inputs**: tensor inputs whose dim 0 is the batch symbol; the symbol's int input becomes
  the budget at replay;
- **graph-set key**: every other symbol (height, width with ``dynamic=True``); each distinct key
  gets its own :class:`~vit_graph_backend.runtime.EncoderCudaGraphManager`, least recently used
  sets freed beyond ``max_graph_sets``;
- **module state** (parameters, buffers, other fixed inputs): referenced by the graphs, not
  copied. Their addresses are checked at every call; one that moved (a replaced parameter, an
  auxiliary input that changes per call) is switched to a copied static buffer and the set is
  captured again, so a graph never reads stale memory.

Budgets count **rows** of the batch axis (default ladder 1, 2, ..., 8, 10, 12, ..., 28, 32). A call is one item of
``B`` rows; more rows than the largest budget are cut into chunks through the same graphs.

Graphs that cannot be served are refused at compile time with one logged reason and run eagerly:
training-mode ops (dropout, batch norm statistics), in-place writes to inputs, outputs that do not
carry the batch axis at dim 0 (they may mix rows, which padding would change).

Dynamo's first compile of a frame is static (no symbol), and so is its separate compile for a
batch of 1. Those graphs run as one exact-shape graph: all non-parameter inputs copied, nothing
padded (``static_graphs=False`` runs them eagerly instead).
"""

from __future__ import annotations

import logging
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _compat
from .budgets import BudgetConfig
from .options import DEFAULT_BATCHED_LADDER_STEPS, DEFAULT_BATCHED_MAX_BUDGET, VitGraphOptions
from .planner import Segment
from .runtime import EncoderCudaGraphManager
from .specs import EncoderItemSpec
from .errors import InvalidOptionError
from .stats import GraphStats

__all__ = ["PACKED_ONLY_OPTIONS", "BatchedGraphEncoder", "analyze_graph", "check_batched_options"]

log = logging.getLogger(__name__)

_data_ptr = torch.Tensor.data_ptr

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
        elif isinstance(fake, (int, float, bool)) or fake is None:
            continue
        else:
            layout.unsupported = f"input {i} of type {type(fake).__name__} is not supported"
    layout.unsupported = layout.unsupported or _unsafe_ops(gm) or _check_outputs(gm, layout)
    return layout


def _mentions(dim: Any, symbol: str) -> bool:
    import re

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


class _GraphSet:
    """One graph set's view of the graph as an encoder for the runtime (row items)."""

    def __init__(self, fn: Callable[..., Any], layout: GraphLayout, template: Sequence[Any],
                 copied: set[int], static_shape: bool, max_rows: int) -> None:
        self.fn, self.layout, self.copied = fn, layout, copied
        self.static_shape = static_shape
        self.template = list(template)
        self.referenced = [i for i in layout.state if i not in copied]
        self.pointers = [template[i].data_ptr() for i in self.referenced]
        # checked at every call (ViT-B: ~150 tensors), so kept to one C-level pass
        self._pick = operator.itemgetter(*self.referenced) if self.referenced else None
        self._row_buffers: dict[int, torch.Tensor] = {}
        self.max_rows = max_rows  # the largest budget: the shared row buffers' size

    # row items: one item per call, B rows (or one "row" for an exact static graph)
    def get_encoder_cudagraph_item_specs(self, args: Sequence[Any]) -> list[EncoderItemSpec]:
        rows = 1 if self.static_shape else args[self.layout.batch_tensors[0]].shape[0]
        return [EncoderItemSpec(rows, rows)]

    def get_encoder_cudagraph_budget_range(self) -> tuple[int, int]:
        return (1, DEFAULT_BATCHED_MAX_BUDGET)

    def prepare_encoder_cudagraph_capture_inputs(self, budget, max_batch_size,
                                                 max_frames_per_batch, device, dtype):
        static = {}
        for i in self.layout.batch_tensors:
            # Budgets share one row buffer (views of its head): calls are ordered on the GPU
            # (stream_order.py) and each writes all ``budget`` rows it reads, so 16 budgets
            # cost one largest buffer.
            buffer = self._row_buffers.get(i)
            if buffer is None or buffer.shape[0] < budget:
                t = self.template[i]
                rows = max(budget, self.max_rows)
                buffer = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
                self._row_buffers[i] = buffer
            static[str(i)] = buffer[:budget]
        for i in self.copied:
            static[str(i)] = self.template[i].detach().clone()
        return static

    def prepare_encoder_cudagraph_replay_segments(self, args, segments: Sequence[Segment],
                                                  budget):
        values = {}
        for i in self.layout.batch_tensors:
            parts = [args[i][s.start:s.stop] for s in segments]
            values[str(i)] = parts[0] if len(parts) == 1 else torch.cat(parts)
        for i in self.copied:
            values[str(i)] = args[i]
        return values

    def prepare_encoder_cudagraph_replay_buffers(self, args, item_indices, budget):
        raise NotImplementedError("batched graphs are driven through the segment API")

    def encoder_cudagraph_forward(self, static):
        args = list(self.template)
        rows = None
        for i in self.layout.batch_tensors:
            args[i] = static[str(i)]
            rows = args[i].shape[0]
        for i in self.layout.batch_ints:
            args[i] = rows
        for i in self.copied:
            args[i] = static[str(i)]
        return self._outputs(self.fn(*args))

    def encoder_eager_forward(self, args, item_indices):
        return self._outputs(self.fn(*args))

    def encoder_eager_segments(self, args, segments: Sequence[Segment]):
        if self.static_shape or (len(segments) == 1 and segments[0].start == 0 and segments[0].stop
                                 == args[self.layout.batch_tensors[0]].shape[0]):
            return self._outputs(self.fn(*args))
        sub = list(args)
        values = self.prepare_encoder_cudagraph_replay_segments(args, segments, None)
        rows = sum(s.tokens for s in segments)
        for i in self.layout.batch_tensors:
            sub[i] = values[str(i)]
        for i in self.layout.batch_ints:
            sub[i] = rows
        return self._outputs(self.fn(*sub))

    def requires_grad(self, args) -> bool:
        return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)

    def _outputs(self, out):
        # An exact static graph is one "row": give every output a leading axis of 1 so the
        # runtime's row slicing keeps it whole; the caller removes it again.
        out = tuple(out)
        return tuple(t.unsqueeze(0) for t in out) if self.static_shape else out

    def moved_inputs(self, args: Sequence[Any]) -> list[int]:
        if self._pick is None:
            return []
        picked = self._pick(args)
        if len(self.referenced) == 1:
            picked = (picked,)
        pointers = list(map(_data_ptr, picked))
        if pointers == self.pointers:
            return []
        return [i for i, p, q in zip(self.referenced, pointers, self.pointers) if p != q]


#: Options of packed encoders only: a batched graph holds one call's rows, not items or frames.
PACKED_ONLY_OPTIONS = ("max_items_per_graph", "max_frames_per_batch")


def check_batched_options(options: VitGraphOptions) -> None:
    """Reject options that a ``torch.compile`` graph (batched rows) cannot apply.

    Raises:
        InvalidOptionError: naming the option, its value and what to use instead.
    """
    for name in PACKED_ONLY_OPTIONS:
        value = getattr(options, name)
        if value is not None:
            raise InvalidOptionError(
                f"{name}={value!r} does not apply to torch.compile(backend='vitgraph'): a "
                "batched encoder's graph holds the rows of one call, and budgets count rows "
                "(bound them with max_budget). It is an option of packed encoders: "
                f"serve(model, {name}={value!r})")


class BatchedGraphEncoder:
    """The callable the ``vitgraph`` backend returns to Dynamo for a batched encoder graph."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                 options: VitGraphOptions, fn: Callable[..., Any]) -> None:
        check_batched_options(options)
        self.options, self.fn = options, fn
        self.layout = analyze_graph(gm, example_inputs)
        self.static_shape = self.layout.batch_symbol is None
        self.stats = GraphStats()   # calls refused before reaching a manager
        self.unsupported = self.layout.unsupported
        if self.unsupported is None and self.static_shape and not options.static_graphs:
            self.unsupported = "static-shape graph and static_graphs=False"
        if self.unsupported is None and self.static_shape:
            # Every non-parameter input is copied: which of them is "the batch" is unknown here.
            self.layout.state = [i for i, x in enumerate(example_inputs)
                                 if isinstance(x, torch.Tensor)]
        if self.unsupported:
            log.warning("vitgraph: serving this graph eagerly: %s", self.unsupported)
        self._copied: set[int] = set()
        if self.static_shape:
            self._copied = {i for i in self.layout.state if i not in self.layout.params}
        self._sets: OrderedDict[tuple, tuple[_GraphSet, EncoderCudaGraphManager]] = OrderedDict()
        self._lock = threading.RLock()
        self._graph_pool: Any = None
        self.evictions = 0

    def __call__(self, *args: Any) -> Any:
        if self.unsupported:
            self.stats.record_call()
            self.stats.record_eager(1, self.unsupported)
            return self.fn(*args)
        with self._lock:
            graph_set, manager = self._set_for(args)
            out = manager.run(args)[0]
        if self.static_shape:
            return tuple(t[0] for t in out)
        return out

    def _set_for(self, args: Sequence[Any]) -> tuple[_GraphSet, EncoderCudaGraphManager]:
        key = tuple(args[i] for i in self.layout.key_ints)
        entry = self._sets.get(key)
        if entry is not None:
            moved = entry[0].moved_inputs(args)
            if not moved:
                self._sets.move_to_end(key)
                return entry
            log.warning("vitgraph: graph inputs %s changed address since capture (replaced "
                        "parameters or per-call auxiliary inputs); copying them into static "
                        "buffers and capturing again", moved)
            self._copied.update(moved)
            self._drop(key)
        while len(self._sets) >= self.options.max_graph_sets:
            self._drop(next(iter(self._sets)))
            self.evictions += 1
        if self.static_shape:
            config = BudgetConfig((1,), 1)
        else:
            # A call is one item of B rows, so a graph has one slot (the backend rejects the
            # packed-only max_items_per_graph and max_frames_per_batch, see backend.py)
            config = self.options.budget_config((1, DEFAULT_BATCHED_MAX_BUDGET),
                                                 DEFAULT_BATCHED_LADDER_STEPS)
            config = BudgetConfig(config.budgets, 1)
        graph_set = _GraphSet(self.fn, self.layout, args, set(self._copied), self.static_shape,
                              config.max_budget)
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        manager = EncoderCudaGraphManager(graph_set, self.options, device=device,
                                          chunk=not self.static_shape, budget_config=config)
        if manager.uses_cuda_graphs:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            manager.graph_pool = self._graph_pool
        self._sets[key] = (graph_set, manager)
        return self._sets[key]

    def _drop(self, key: tuple) -> None:
        _, manager = self._sets.pop(key)
        self.stats.merge(manager.stats)
        manager.clear()

    @property
    def managers(self) -> list[EncoderCudaGraphManager]:
        """Live graph sets' managers, least recently used first."""
        return [m for _, m in self._sets.values()]

    def clear(self) -> None:
        """Free every graph set (graphs, buffers, pool)."""
        with self._lock:
            for key in list(self._sets):
                self._drop(key)
            self._graph_pool = None
