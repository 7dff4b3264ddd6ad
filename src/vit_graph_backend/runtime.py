"""`EncoderCudaGraphManager`: budgets, static buffers, one shared graph pool, capture and replay.

One manager serves one encoder (or, for batched ``torch.compile`` graphs, one graph set). For each
call it asks the encoder for item specs, plans batches (``planner``), and runs each batch:

- a **graph batch** copies the encoder's replay buffers into the budget's static buffers (a short
  buffer is copied into the head and its tail zeroed, so no stale or NaN padding survives), replays
  the budget's CUDA graph, clones the real rows once and hands each item a view of its rows;
- an **eager batch** (an item larger than every budget, a budget whose capture failed, grad
  required) runs ``encoder_eager_forward`` and is counted in ``stats`` with its reason.

Budgets are captured **largest first into one graph pool** so smaller graphs reuse the largest
one's memory. Graph outputs stay alive (they are the static outputs), so later captures never hand
out their memory; intermediates of different graphs share pool memory, which is safe because
replays are serialized under this manager's lock on one stream.

Without CUDA the same plan, pad, run and slice path runs with the static buffers but no graph, so
CPU tests exercise routing and padding for real.

Encoders reach the manager through :class:`~vit_graph_backend.protocol.SupportsEncoderCudaGraph`.
An encoder whose items are runs of independent rows may also implement
``prepare_encoder_cudagraph_replay_segments(inputs, segments, budget)`` and
``encoder_eager_segments(inputs, segments)``; the manager then passes planner segments instead of
item indices, which lets it cut one large item into budget-sized chunks (``chunk=True``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import _compat
from .budgets import BudgetConfig
from .errors import InvalidOptionError, UnsupportedGraphError
from .options import VitGraphOptions
from .planner import Batch, Plan, Segment, eager_reason, plan_batches
from .protocol import SupportsEncoderCudaGraph
from .specs import EncoderItemSpec
from .stats import GraphStats

__all__ = ["EncoderCudaGraphManager", "infer_device_dtype", "map_output"]

log = logging.getLogger(__name__)

_DEFAULT_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
_PLAN_CACHE_SIZE = 1024


def map_output(out: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to a tensor output, or to each tensor of a tuple/list output."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    return type(out)(fn(t) for t in out)


def _max_rel_error(actual: Any, expected: Any) -> float:
    worst = 0.0
    for a, e in zip(_tensors(actual), _tensors(expected)):
        scale = max(float(e.abs().max()) if e.numel() else 0.0, 1.0)
        diff = (a.float() - e.float()).abs()
        err = float(diff.max()) if diff.numel() else 0.0
        if not (err == err):  # NaN
            return float("inf")
        worst = max(worst, err / scale)
    return worst


def _tensors(out: Any) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else list(out)


@dataclass
class _BudgetGraph:
    """One budget's static buffers, its graph (``None`` without CUDA) and its static output."""

    budget: int
    static: dict[str, torch.Tensor]
    graph: Any = None
    output: Any = None
    verified: bool = False


class EncoderCudaGraphManager:
    """Serve an encoder's calls from one CUDA graph per token budget.

    Args:
        model: the encoder, implementing ``SupportsEncoderCudaGraph``.
        options: budgets, policy, capture and verification settings.
        device: where static buffers live; ``None`` for the model's first parameter's device.
        dtype: dtype of floating capture inputs; ``None`` for the model's parameter dtype.
        chunk: cut row items larger than the largest budget into chunks (needs the segment API).
        budget_config: a resolved config to use instead of resolving ``options`` against the
            model's budget range.

    Example::

        manager = EncoderCudaGraphManager(adapter, VitGraphOptions(max_items_per_graph=4))
        manager.capture()                      # optional: the first call captures otherwise
        outputs = manager.run({"pixel_values": pv, "grid_thw": grid})   # one output per item
        print(manager.stats.as_dict(), manager.memory_report())
    """

    def __init__(
        self,
        model: SupportsEncoderCudaGraph,
        options: VitGraphOptions | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        chunk: bool = False,
        budget_config: BudgetConfig | None = None,
    ) -> None:
        self.model = model
        self.options = options if options is not None else VitGraphOptions()
        self.config = budget_config or self.options.budget_config(
            model.get_encoder_cudagraph_budget_range())
        self.device, self.dtype = infer_device_dtype(model, device, dtype)
        self._segment_api = hasattr(model, "prepare_encoder_cudagraph_replay_segments")
        if chunk and not self._segment_api:
            raise InvalidOptionError(
                "chunk=True needs an encoder with prepare_encoder_cudagraph_replay_segments "
                "(row items); packed encoders cannot cut an item"
            )
        self.chunk = chunk
        self.stats = GraphStats()
        self.graph_pool: Any = None
        self.capture_seconds = 0.0
        self._graphs: dict[int, _BudgetGraph] = {}
        self._disabled: dict[int, str] = {}
        self._off_reason: str | None = None
        self._logged: set[str] = set()
        self._lock = threading.RLock()
        self._plans: dict[tuple[EncoderItemSpec, ...], Plan] = {}
        self._active = self.config
        self._pool_bytes: int | None = None
        if self.device.type != "cuda":
            _log_cpu_once()
        reason_fn = getattr(model, "graph_unsupported_reason", None)
        reason = reason_fn() if callable(reason_fn) else None
        if reason:
            self.disable_graphs(reason)

    # ----------------------------------------------------------------------------- introspection
    @property
    def uses_cuda_graphs(self) -> bool:
        """True if calls can replay CUDA graphs (CUDA device, graphs not disabled)."""
        return self.device.type == "cuda" and self._off_reason is None

    @property
    def token_budgets(self) -> tuple[int, ...]:
        """Budgets still served by graphs (a budget whose capture failed is dropped)."""
        return self._active.budgets if self._off_reason is None else ()

    def get_num_graphs_to_capture(self) -> int:
        """Graphs :meth:`capture` would hold: one per budget, 0 without CUDA or with graphs off."""
        return len(self.token_budgets) if self.uses_cuda_graphs else 0

    @property
    def num_graphs(self) -> int:
        """Graphs captured now."""
        return sum(1 for g in self._graphs.values() if g.graph is not None)

    def memory_report(self) -> dict[str, Any]:
        """Memory the captured set holds, measured from the CUDA caching allocator.

        ``pool_bytes`` is what the allocator reserved for the shared graph pool (intermediates and
        static outputs); ``static_input_bytes`` the static input buffers outside it.
        """
        # budgets may share one buffer (views of its head): count each storage once
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for g in self._graphs.values() for t in g.static.values()}
        static = sum(storages.values())
        pool = self._pool_bytes or 0
        return {
            "graphs": self.num_graphs,
            "budgets": list(self.token_budgets),
            "largest_budget": max(self._graphs) if self._graphs else None,
            "pool_bytes": pool,
            "static_input_bytes": static,
            "total_bytes": pool + static,
            "capture_seconds": round(self.capture_seconds, 4),
            "disabled_budgets": dict(self._disabled),
            "graphs_off_reason": self._off_reason,
        }

    # ------------------------------------------------------------------------------- life cycle
    def disable_graphs(self, reason: str) -> None:
        """Serve every later call eagerly, logging ``reason`` once."""
        self._off_reason = reason
        self._log_once(f"vitgraph: CUDA graphs disabled for this encoder: {reason}")

    def capture(self, graph_pool: Any = None) -> None:
        """Capture every budget, largest first, into one pool.

        Args:
            graph_pool: a ``torch.cuda.graph_pool_handle()`` to capture into (kept as given, e.g.
                one shared with other graphs of the application); ``None`` creates one.
        """
        with self._lock:
            if not self.uses_cuda_graphs:
                if self.device.type != "cuda":
                    self._log_once("vitgraph: CUDA graphs need a CUDA device; running the "
                                   "budgeted plan/pad/slice path without graphs")
                return
            if graph_pool is not None:
                self.graph_pool = graph_pool
            for budget in sorted(self.token_budgets, reverse=True):
                if budget not in self._graphs:
                    self._capture_budget(budget)
            log.info("vitgraph: captured %d graphs (budgets %s, largest %s) in %.2f s, "
                     "pool %s bytes", self.num_graphs, list(self.token_budgets),
                     max(self._graphs, default=None), self.capture_seconds, self._pool_bytes)

    def clear(self) -> None:
        """Drop graphs, static buffers and the pool; a later call captures again."""
        with self._lock:
            self._graphs.clear()
            self.graph_pool = None
            self._pool_bytes = None
            self._plans.clear()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------------ calls
    def run(self, inputs: Any) -> list[Any]:
        """Run one call; returns one output per item, in the caller's order."""
        specs = tuple(self.model.get_encoder_cudagraph_item_specs(inputs))
        with self._lock:
            self.stats.record_call()
            reason = self._off_reason or self._grad_reason(inputs)
            if reason is not None:
                plan = Plan((Batch(tuple(Segment(i, 0, s.output_tokens)
                                         for i, s in enumerate(specs)), None,
                                   sum(s.frames for s in specs)),), len(specs),
                            tuple(range(len(specs))))
            else:
                plan = self._plan(specs)
                if (self.options.capture == "all" and self.uses_cuda_graphs
                        and any(b not in self._graphs for b in self.token_budgets)):
                    self.capture()
            pieces: list[list[tuple[int, Any]]] = [[] for _ in specs]
            for batch in plan.batches:
                outs = self._run_batch(inputs, batch, reason)
                for seg, out in zip(batch.segments, outs):
                    pieces[seg.item].append((seg.start, out))
            return [_assemble(p) for p in pieces]

    def _plan(self, specs: tuple[EncoderItemSpec, ...]) -> Plan:
        plan = self._plans.get(specs)
        if plan is None:
            plan = plan_batches(specs, self._active, policy=self.options.policy,
                                chunk=self.chunk)
            if len(self._plans) >= _PLAN_CACHE_SIZE:
                self._plans.clear()
            self._plans[specs] = plan
        return plan

    def _run_batch(self, inputs: Any, batch: Batch, reason: str | None) -> list[Any]:
        if batch.budget is None or reason is not None:
            return self._eager(inputs, batch, reason or eager_reason(batch, self._active))
        if batch.budget in self._disabled:
            return self._eager(inputs, batch, self._disabled[batch.budget])
        try:
            outs = self._replay(inputs, batch)
        except UnsupportedGraphError as exc:  # this batch only (e.g. more frames than captured)
            return self._eager(inputs, batch, f"batch not servable by graph: {exc}")
        except Exception as exc:  # a graph path must never crash a user's call
            why = f"replay failed: {type(exc).__name__}: {exc}"
            self._disable_budget(batch.budget, why)
            return self._eager(inputs, batch, why)
        if outs is None:  # verification failed, budget now disabled
            return self._eager(inputs, batch, self._disabled[batch.budget])
        return outs

    def _replay(self, inputs: Any, batch: Batch) -> list[Any] | None:
        budget = batch.budget
        assert budget is not None
        entry = self._graphs.get(budget)
        if entry is None:
            if self.uses_cuda_graphs:
                self._capture_budget(budget)
                if budget in self._disabled:
                    return self._eager(inputs, batch, self._disabled[budget])
                entry = self._graphs[budget]
            else:
                entry = self._graphs[budget] = _BudgetGraph(budget, self._capture_inputs(budget))
        values = self._replay_buffers(inputs, batch, budget)
        for key, value in values.items():
            _copy_padded(entry.static, key, value)
        if entry.graph is not None:
            entry.graph.replay()
            out = entry.output
        else:
            with torch.no_grad():
                out = self.model.encoder_cudagraph_forward(entry.static)
        n = batch.tokens
        real = map_output(out, lambda t: t[:n].clone())
        if self.options.verify and not entry.verified:
            expected = self._eager_packed(inputs, batch)
            err = _max_rel_error(real, map_output(expected, lambda t: t[:n]))
            tol = self.options.verify_tolerance or _DEFAULT_TOLERANCE.get(self.dtype, 1e-3)
            if err > tol:
                self._disable_budget(
                    budget, f"verification failed: max relative error {err:.3g} > {tol:.3g}",
                    warn=True)
                return None
            entry.verified = True
            log.info("vitgraph: budget %d verified against eager (max relative error %.3g)",
                     budget, err)
        self.stats.record_replay(budget, len(batch.segments), n)
        return _split(real, batch.segments)

    def _eager(self, inputs: Any, batch: Batch, reason: str) -> list[Any]:
        self.stats.record_eager(len(batch.segments), reason)
        log.debug("vitgraph: eager batch of %d segments: %s", len(batch.segments), reason)
        return _split(self._eager_packed(inputs, batch), batch.segments)

    def _eager_packed(self, inputs: Any, batch: Batch) -> Any:
        if self._segment_api:
            return self.model.encoder_eager_segments(inputs, batch.segments)  # type: ignore[attr-defined]
        return self.model.encoder_eager_forward(inputs, list(batch.items))

    def _replay_buffers(self, inputs: Any, batch: Batch, budget: int) -> Mapping[str, torch.Tensor]:
        if self._segment_api:
            return self.model.prepare_encoder_cudagraph_replay_segments(  # type: ignore[attr-defined]
                inputs, batch.segments, budget)
        return self.model.prepare_encoder_cudagraph_replay_buffers(inputs, list(batch.items), budget)

    def _capture_inputs(self, budget: int) -> dict[str, torch.Tensor]:
        return dict(self.model.prepare_encoder_cudagraph_capture_inputs(
            budget, self.config.max_batch_size, self.config.max_frames_per_batch,
            self.device, self.dtype))

    def _capture_budget(self, budget: int) -> None:
        start = time.perf_counter()
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        try:
            static = self._capture_inputs(budget)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(self.options.warmup_iters):
                    self.model.encoder_cudagraph_forward(static)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(graph, pool=self.graph_pool,
                                                   capture_error_mode="thread_local"):
                output = self.model.encoder_cudagraph_forward(static)
        except Exception as exc:  # e.g. out of memory, a host sync or CPU op in the forward
            self._disable_budget(budget, f"capture failed: {type(exc).__name__}: {exc}", warn=True)
            return
        finally:
            self.capture_seconds += time.perf_counter() - start
        self._graphs[budget] = _BudgetGraph(budget, static, graph, output)
        self._pool_bytes = _compat.graph_pool_bytes(self.graph_pool, self.device)

    def _disable_budget(self, budget: int, reason: str, warn: bool = False) -> None:
        self._disabled[budget] = reason
        self._graphs.pop(budget, None)
        remaining = tuple(b for b in self.config.budgets if b not in self._disabled)
        self._plans.clear()
        if remaining:
            self._active = BudgetConfig(remaining, self.config.max_batch_size,
                                        self.config.max_frames_per_batch)
        else:
            self.disable_graphs("every budget failed: " + reason)
        message = f"vitgraph: budget {budget} falls back to eager: {reason}"
        if warn:
            import warnings

            warnings.warn(message, RuntimeWarning, stacklevel=3)
        self._log_once(message)

    def _grad_reason(self, inputs: Any) -> str | None:
        if not torch.is_grad_enabled():
            return None
        grad_fn = getattr(self.model, "requires_grad", None)
        if callable(grad_fn):
            needs_grad = grad_fn(inputs)
        else:
            needs_grad = any(t.requires_grad for t in _input_tensors(inputs)) or (
                isinstance(self.model, torch.nn.Module)
                and any(p.requires_grad for p in self.model.parameters()))
        if needs_grad:
            reason = "grad required (graphs serve inference; use torch.no_grad())"
            self._log_once("vitgraph: " + reason + "; running eagerly")
            return reason
        return None

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.warning(message)


_CPU_LOGGED = False


def _log_cpu_once() -> None:
    global _CPU_LOGGED
    if not _CPU_LOGGED:
        _CPU_LOGGED = True
        log.warning("vitgraph: CUDA graphs need a CUDA device; on %s the same plan, pad, run and "
                    "slice path runs without graphs", "this device")


def _input_tensors(inputs: Any) -> list[torch.Tensor]:
    values = inputs.values() if isinstance(inputs, Mapping) else inputs
    if isinstance(values, torch.Tensor):
        return [values]
    return [v for v in values if isinstance(v, torch.Tensor)]


def _copy_padded(static: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    try:
        target = static[key]
    except KeyError:
        raise KeyError(f"replay buffer {key!r} has no capture buffer (have {sorted(static)})"
                       ) from None
    if value.shape == target.shape:
        target.copy_(value)
        return
    n = value.shape[0]
    if value.dim() != target.dim() or value.shape[1:] != target.shape[1:] or n > target.shape[0]:
        raise ValueError(f"replay buffer {key!r} of shape {tuple(value.shape)} does not fit its "
                         f"capture buffer of shape {tuple(target.shape)}")
    target[:n].copy_(value)
    target[n:].zero_()


def _split(out: Any, segments: Sequence[Segment]) -> list[Any]:
    """Per-segment views of a packed output whose rows hold the segments back to back."""
    result, offset = [], 0
    for seg in segments:
        lo, hi = offset, offset + seg.tokens
        result.append(map_output(out, lambda t, lo=lo, hi=hi: t[lo:hi]))
        offset = hi
    return result


def _assemble(pieces: list[tuple[int, Any]]) -> Any:
    if len(pieces) == 1:
        return pieces[0][1]
    pieces.sort(key=lambda p: p[0])
    first = pieces[0][1]
    if isinstance(first, torch.Tensor):
        return torch.cat([p[1] for p in pieces])
    return type(first)(torch.cat([p[1][i] for p in pieces]) for i in range(len(first)))


def infer_device_dtype(model: Any, device: Any = None, dtype: Any = None) -> tuple[torch.device, torch.dtype]:
    """``(device, dtype)`` given, or else those of ``model``'s first parameter (CPU/fp32 if none)."""
    param = None
    if isinstance(model, torch.nn.Module):
        param = next(iter(model.parameters()), None)
    if device is None:
        device = param.device if param is not None else torch.device("cpu")
    if dtype is None:
        dtype = param.dtype if param is not None else torch.float32
    return torch.device(device), dtype
