"""Batched encoders under ``torch.compile``: one Dynamo graph, padded along its item axis.

``layout.py`` reads the graph once: batch inputs, the graph-set key (other symbols; one
:class:`~vit_graph_backend.runtime.manager.EncoderCudaGraphManager` per key, LRU beyond
``max_graph_sets``) and module state, referenced rather than copied until its address moves.
Budgets count rows; a call is one item, chunked beyond the largest budget. Dynamo's static
compiles run as one exact-shape graph, getting the inner compiler only at their second call and
only without a dynamic graph of the same model (otherwise a whole compile is spent on a graph
Dynamo soon replaces, or stalls a stream mid-way).
"""

from __future__ import annotations

import logging
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .layout import GraphLayout, analyze_graph
from ..budgets import BudgetConfig
from ..options import DEFAULT_BATCHED_MAX_BUDGET, VitGraphOptions
from ..planner import Segment
from ..runtime.manager import EncoderCudaGraphManager
from ..specs import EncoderItemSpec
from ..stats import GraphStats

__all__ = ["BatchedGraphEncoder"]

log = logging.getLogger(__name__)

_data_ptr = torch.Tensor.data_ptr

class _GraphSet:
    """One graph set's view of the graph as an encoder for the runtime (row items)."""

    def __init__(self, fn: Callable[..., Any], layout: GraphLayout, template: Sequence[Any],
                 copied: set[int], static_shape: bool, max_rows: int) -> None:
        self.fn, self.layout, self.copied = fn, layout, copied
        self.static_shape = static_shape
        self.template = list(template)
        self.referenced = [i for i in layout.state if i not in copied]
        self.pointers = [template[i].data_ptr() for i in self.referenced]
        # checked at every call, so kept to one C-level pass
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
            # budgets share one row buffer (views of its head): calls are ordered on the GPU
            # and each writes every row it reads
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

    def encoder_reference_forward(self, args):
        # the traced graph touches no static buffer: safe beside a background capture
        return self.encoder_eager_forward(args, None)

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
        # an exact static graph is one "row": a leading axis of 1, removed by the caller
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


def _empty(args: Sequence[Any], layout: GraphLayout) -> str | None:
    """Why a call has nothing to replay: its batch inputs hold no rows."""
    for i in layout.batch_tensors:
        if args[i].shape[0] == 0:
            return f"input {i} holds an empty batch (0 rows)"
    return None


class BatchedGraphEncoder:
    """The callable the ``vitgraph`` backend returns to Dynamo for a batched encoder graph."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                 options: VitGraphOptions, compile_fn: Callable[[], Callable[..., Any]], *,
                 defer: Callable[[BatchedGraphEncoder], bool] | None = None) -> None:
        """``compile_fn()`` returns the inner-compiled graph. With ``defer``, a static graph
        runs ``gm`` until its second call, then is compiled if ``defer(self)`` is true."""
        #: the row budgets of every graph set, resolved once at compile time
        self.config = options.resolve(batched=True)
        self.options = options
        self.layout = analyze_graph(gm, example_inputs)
        self.static_shape = self.layout.batch_symbol is None
        self.stats = GraphStats()   # calls refused before reaching a manager
        self.unsupported = self.layout.unsupported
        if self.unsupported is None and self.static_shape and not options.static_graphs:
            self.unsupported = "static-shape graph and static_graphs=False"
        self._gm = gm
        #: set for Dynamo's static compile of an empty batch
        self._empty = None
        if self.static_shape and any(
                isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter)
                and x.dim() > 0 and x.shape[0] == 0 for x in example_inputs):
            self._empty = "a graph made for an empty batch (nothing to replay)"
            self.unsupported = self.unsupported or self._empty
        if self.unsupported is None and self.static_shape:
            # every non-parameter input is copied: which is "the batch" is unknown
            self.layout.state = [i for i, x in enumerate(example_inputs)
                                 if isinstance(x, torch.Tensor)]
        if self.unsupported:
            (log.info if self._empty else log.warning)(
                "vitgraph: serving this graph eagerly: %s", self.unsupported)
        #: the parameters this graph reads, by identity: graphs of one model share them
        self.param_ids = frozenset(id(example_inputs[i]) for i in self.layout.params)
        self._compile_later: Callable[[], Callable[..., Any] | None] | None = None
        self.fn: Callable[..., Any] = gm
        if defer is not None and self.static_shape and self.unsupported is None:
            self._compile_later = lambda: compile_fn() if defer(self) else None
        elif self._empty is None:
            self.fn = compile_fn()
        self._copied: set[int] = ({i for i in self.layout.state if i not in self.layout.params}
                                  if self.static_shape else set())
        # shapes a pinned graph (see analyze_graph) was made for; other calls run eagerly
        self._pinned = [(i, x.shape if isinstance(x, torch.Tensor) else x)
                        for i, x in enumerate(example_inputs)
                        if self.layout.pinned and not isinstance(x, torch.nn.Parameter)]
        self._warned_shape = False
        self._sets: OrderedDict[tuple, tuple[_GraphSet, EncoderCudaGraphManager]] = OrderedDict()
        self._lock = threading.RLock()
        self._graph_pool: Any = None
        self.evictions = 0

    def __call__(self, *args: Any) -> Any:
        empty = _empty(args, self.layout) or self._empty
        reason = empty or self.unsupported or (self._pinned and self._off_shape(args))
        if reason:
            self.stats.record_call()
            self.stats.record_eager(1, reason)
            # no rows: the traced graph as is (compiled code may not take zero rows)
            return self._gm(*args) if empty else self.fn(*args)
        with self._lock:
            if self._compile_later is not None and self._sets:  # a set: called before
                self._compile_deferred()
            out = self._run(args)
        if self.static_shape:
            return tuple(t[0] for t in out)
        return out

    def _run(self, args: Sequence[Any]) -> Any:
        """One call through its graph set. A new set replaces anything only once the call has
        returned, so a call that raises leaves every set, copy and pool as it found them."""
        key = tuple(args[i] for i in self.layout.key_ints)
        entry = self._sets.get(key)
        moved = entry[0].moved_inputs(args) if entry is not None else []
        if entry is not None and not moved:
            self._sets.move_to_end(key)
            return entry[1].run(args)[0]
        graph_set, manager = self._new_set(args, self._copied | set(moved))
        try:
            out = manager.run(args)[0]
        except BaseException:
            manager.clear()
            raise
        if moved:
            # warn for replaced parameters or large tensors; small per-call scalars are expected
            worth = [i for i in moved if i in self.layout.params or args[i].numel() > 64]
            (log.warning if worth else log.info)(
                "vitgraph: graph inputs %s changed address since capture (%s); copying them "
                "into static buffers and capturing again", moved,
                "replaced parameters or per-call tensors" if worth
                else "small tensors made at each call")
            self._copied.update(moved)
            self._drop(key)
        while len(self._sets) >= self.options.max_graph_sets:
            self._drop(next(iter(self._sets)))
            self.evictions += 1
        if manager.graph_pool is not None:
            self._graph_pool = manager.graph_pool
        self._sets[key] = (graph_set, manager)
        return out

    def _compile_deferred(self) -> None:
        # called again: compile, and capture anew around the compiled graph
        compile_fn, self._compile_later = self._compile_later, None
        assert compile_fn is not None
        fn = compile_fn()
        if fn is None:
            log.info("vitgraph: static graph called again beside a dynamic graph of the same "
                     "model: it keeps the traced graph's kernels (no compile mid-stream)")
            return
        log.info("vitgraph: static graph called again: compiled with the inner compiler")
        for key in list(self._sets):
            self._drop(key)
        self.fn = fn

    @property
    def compile_pending(self) -> bool:
        """True while a static graph's inner compile is put off to its second call."""
        return self._compile_later is not None

    def _off_shape(self, args: Sequence[Any]) -> str | None:
        for i, expected in self._pinned:
            got = args[i].shape if isinstance(args[i], torch.Tensor) else args[i]
            if got != expected:
                if not self._warned_shape:
                    self._warned_shape = True
                    log.warning("vitgraph: running eagerly: a graph made for a batch of 1 was "
                                "called with input %d of %s (logged once)", i, got)
                return (f"graph made for a batch of 1 called with input {i} of {got} "
                        f"(made for {expected})")
        return None

    def _new_set(self, args: Sequence[Any], copied: set[int]
                 ) -> tuple[_GraphSet, EncoderCudaGraphManager]:
        exact_rows = None
        if self.static_shape:
            config = BudgetConfig((1,), 1)
            # stats count the call's real rows, not the internal budget of 1
            exact_rows = next((a.shape[0] for a in args if isinstance(a, torch.Tensor)
                               and not isinstance(a, torch.nn.Parameter) and a.dim() > 0), 1)
        else:
            config = self.config  # a call is one item of B rows: one slot per graph
        graph_set = _GraphSet(self.fn, self.layout, args, copied, self.static_shape,
                              config.max_budget)
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        manager = EncoderCudaGraphManager(graph_set, self.options, device=device,
                                          chunk=not self.static_shape, budget_config=config,
                                          exact_rows=exact_rows)
        if manager.uses_cuda_graphs:
            # never into a pool whose graphs were all dropped: the allocator asserts (use_count > 0)
            alive = self._graph_pool is not None and self._sets
            manager.graph_pool = self._graph_pool if alive else torch.cuda.graph_pool_handle()
        return graph_set, manager

    def _drop(self, key: tuple) -> None:
        _, manager = self._sets.pop(key)
        self.stats.merge(manager.stats)
        manager.clear()

    @property
    def managers(self) -> list[EncoderCudaGraphManager]:
        """Live graph sets' managers, least recently used first."""
        return [m for _, m in list(self._sets.values())]   # one C-level copy: no lock needed

    def clear(self) -> None:
        """Free every graph set (graphs, buffers, pool)."""
        with self._lock:
            for key in list(self._sets):
                self._drop(key)
            self._graph_pool = None
