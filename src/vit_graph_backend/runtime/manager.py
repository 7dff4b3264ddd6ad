"""`EncoderCudaGraphManager`: plans each call, pads batches into budgets and replays their graphs.

A graph batch copies replay buffers into the budget's static buffers (tails zeroed), replays and
hands each item a view of one clone of the real rows; an eager batch (oversize item, failed
budget, grad, hooks or patched code) runs ``encoder_eager_forward`` and is counted with its reason.
Each call's GPU work is ordered after the previous call's (``stream_order``), so any thread on any
stream gets what eager would give it. Without CUDA the same path runs without graphs.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from ..budgets import BudgetConfig
from ..errors import InvalidInputError, InvalidOptionError, UnsupportedGraphError, error_line
from .capture import (BudgetGraphs, CaptureOutcome, beside_captures, capture_broken,
                      capture_lock, mib)
from ..options import VitGraphOptions
from ..planner import Batch, Segment
from .replay_io import (assemble, head_copy, infer_device_dtype, map_output, max_rel_error,
                        needs_grad, split_rows, verify_tolerance, write_inputs)
from ..protocol import SupportsEncoderCudaGraph
from .served_budgets import ServedBudgets
from ..stats import GraphStats
from .stream_order import order_for
from .weights import WeightSlots, python_outside_graphs

__all__ = ["EncoderCudaGraphManager", "infer_device_dtype", "map_output"]

log = logging.getLogger(__name__)

#: The reason counted for a call answered while its graphs are prepared (``capture="background"``).
PREPARING = "graphs being prepared in the background (capture='background')"


class EncoderCudaGraphManager:
    """Serve an encoder's calls from one CUDA graph per token budget.

    Args:
        model: the encoder, implementing ``SupportsEncoderCudaGraph``.
        options: budgets, policy, capture and verification settings.
        device: where static buffers live; ``None`` for the model's first parameter's device.
        dtype: dtype of floating capture inputs; ``None`` for the model's parameter dtype.
        chunk: cut row items larger than the largest budget into chunks (needs the segment API).
        budget_config: a resolved config instead of resolving ``options``.
        exact_rows: for an exact-shape graph: the call's real rows, counted in ``stats``.
        pad_without_graphs: without CUDA, pad each batch and run the captured computation over
            static buffers as a graph would (tests); ``None`` for the class default (``False``:
            each planned batch runs eagerly at its own size).
        watch: the module whose weights the graphs read (``weights.py``); ``None`` for ``model``
            itself where it is a module.
    """

    #: default of ``pad_without_graphs``; CPU padding tests set it (fixture ``padded_cpu``)
    pad_without_graphs = False

    def __init__(
        self,
        model: SupportsEncoderCudaGraph,
        options: VitGraphOptions | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        chunk: bool = False,
        budget_config: BudgetConfig | None = None,
        exact_rows: int | None = None,
        pad_without_graphs: bool | None = None,
        watch: Any = None,
    ) -> None:
        self.model = model
        self.options = options if options is not None else VitGraphOptions()
        self.config = budget_config or self.options.resolve(
            model.get_encoder_cudagraph_budget_range())
        self.device, self.dtype = infer_device_dtype(model, device, dtype)
        self._segment_api = hasattr(model, "prepare_encoder_cudagraph_replay_segments")
        if chunk and not self._segment_api:
            raise InvalidOptionError(
                "chunk=True needs an encoder with prepare_encoder_cudagraph_replay_segments "
                "(row items); packed encoders cannot cut an item"
            )
        self.chunk = chunk
        self.exact_rows = exact_rows
        if pad_without_graphs is None:
            pad_without_graphs = type(self).pad_without_graphs
        self.pads = self.device.type == "cuda" or pad_without_graphs
        self.stats = GraphStats()
        self.graphs = BudgetGraphs(model, self.options.warmup_iters, self.options.max_graph_memory,
                                   self.config.max_batch_size, self.config.max_frames_per_batch,
                                   self.device, self.dtype, self.options.graph_launch)
        self._graphs = self.graphs.entries
        self.served = ServedBudgets(self.config, self.options.policy, chunk)
        self._off_reason: str | None = None
        self._all_budgets_failed = False   # graphs off only because every budget was disabled
        self._logged: set[str] = set()
        self._lock = threading.RLock()
        self.watched = watch if watch is not None else (
            model if isinstance(model, torch.nn.Module) else None)
        self.weights = WeightSlots(self.watched) if self.watched is not None else None
        #: the encoder's optional weight-copy refresh, called once a call after its first launch
        self._refresh = getattr(model, "refresh_encoder_cudagraph_weights", None)
        self.order = order_for(self.device)
        #: the background preparation (``capture="background"``), while it runs
        self._preparer: threading.Thread | None = None
        self._preparing = False
        #: bumped by each preparation and cancel: a preparation serves its set only while current
        self._generation = 0
        self._background_mode = self.options.capture == "background"
        #: seconds from the first call to the switch to graphs, once prepared in the background
        self.prepare_seconds: float | None = None
        if self.device.type != "cuda":
            _log_cpu_once()
        reason = getattr(model, "graph_unsupported_reason", lambda: None)()
        if reason:
            self.disable_graphs(reason)

    @property
    def uses_cuda_graphs(self) -> bool:
        """True if calls can replay CUDA graphs (CUDA device, graphs not disabled)."""
        return self.device.type == "cuda" and self._off_reason is None

    @property
    def token_budgets(self) -> tuple[int, ...]:
        """Budgets still served by graphs (a budget whose capture failed is dropped)."""
        return self.served.budgets if self._off_reason is None else ()

    def get_num_graphs_to_capture(self) -> int:
        """Graphs :meth:`capture` would hold: one per budget, 0 without CUDA or with graphs off."""
        return len(self.token_budgets) if self.uses_cuda_graphs else 0

    @property
    def num_graphs(self) -> int:
        """Graphs captured now."""
        return self.graphs.num_graphs

    @property
    def graph_pool(self) -> Any:
        """The pool the next capture goes into (``None`` until the first capture)."""
        return self.graphs.graph_pool

    @graph_pool.setter
    def graph_pool(self, pool: Any) -> None:
        self.graphs.graph_pool = pool

    @property
    def capture_seconds(self) -> float:
        """Seconds spent capturing (warm-ups included)."""
        return self.graphs.capture_seconds

    def memory_report(self) -> dict[str, Any]:
        """Memory the captured set holds, from the CUDA caching allocator: ``pool_bytes`` (graph
        pools), ``static_input_bytes``, ``skipped_budgets`` and ``disabled_budgets`` (each with
        its reason), ``estimated_bytes`` (warm-up estimates per budget)."""
        return {**self.graphs.report(), "budgets": list(self.token_budgets),
                "disabled_budgets": dict(self.served.disabled),
                "graphs_off_reason": self._off_reason, "preparing": self._preparing,
                "prepare_seconds": self.prepare_seconds}

    def disable_graphs(self, reason: str) -> None:
        """Serve every later call eagerly, logging ``reason`` once."""
        self._off_reason = reason
        self._log_once(f"vitgraph: CUDA graphs disabled for this encoder: {reason}")

    def capture(self, graph_pool: Any = None) -> None:
        """Capture every budget, largest first, into ``graph_pool`` (kept as given, e.g. one
        shared with other graphs of the application; ``None`` creates one). A background
        preparation is cancelled first, after its capture in progress."""
        with self._lock:
            self._stop_preparing()
            if not self.uses_cuda_graphs:  # off CUDA: logged once per process (_log_cpu_once)
                return
            if graph_pool is not None:
                self.graph_pool = graph_pool
            for budget in sorted(self.token_budgets, reverse=True):
                if budget not in self._graphs:
                    self._capture_budget(budget)
            report = self.memory_report()
            log.info("vitgraph: captured %d graphs (budgets %s) in %.2f s, %s; skipped %s",
                     self.num_graphs, report["captured_budgets"], self.capture_seconds,
                     mib(report["total_bytes"]), report["skipped_budgets"] or "none")

    def clear(self) -> None:
        """Drop graphs, static buffers and the pool; a later call captures again. Waits for a
        background preparation's capture in progress, which it cancels."""
        with self._lock:
            self._stop_preparing()
            # no replay of these graphs may still run on any stream; the device-wide sync and
            # frees never while another thread captures (CUDA refuses both then)
            with self.order, capture_lock(self.device):
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self._reenable_skipped()
                self.graphs.clear()
                self.served.clear_plans()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    def _reenable_skipped(self) -> None:
        # memory may have been freed since: budgets skipped at capture get another try
        skipped = list(self.graphs.skipped)
        if skipped and self.served.enable(skipped) and self._all_budgets_failed:
            self._off_reason, self._all_budgets_failed = None, False

    def run(self, inputs: Any) -> list[Any]:
        """Run one call: one output per item, in the caller's order."""
        specs = tuple(self.model.get_encoder_cudagraph_item_specs(inputs))
        if not self._preparing:
            with self._lock:
                if not self._preparing and not (self._background_mode
                                                and self._background(inputs)):
                    return self._run_locked(inputs, specs)
        # capture="background": the model's own forward, holding neither lock nor stream order
        self.stats.record_call()
        return self._whole(inputs, specs, PREPARING)

    def _run_locked(self, inputs: Any, specs: tuple[Any, ...]) -> list[Any]:
        if self._graphs and self.weights is not None and self.weights.moved():
            self._follow_moved_weights()
        self.stats.record_call()
        call = _Call(self._off_reason or self._grad_reason(inputs))
        pieces: list[list[tuple[int, Any]]] = [[] for _ in specs]
        stream = self.order.enter()
        try:
            if (call.reason is None and self.options.capture != "lazy"
                    and self.uses_cuda_graphs
                    and any(b not in self._graphs for b in self.token_budgets)):
                if not self._graphs:
                    self._python_outside()
                if self._off_reason is None:
                    self.capture()   # before planning: a skipped budget changes the plan
                call.reason = self._off_reason
            if call.reason is not None:  # one batch of every item, as the model's call
                return self._whole(inputs, specs, call.reason)
            for batch in self.served.plan(specs).batches:
                for seg, out in zip(batch.segments, self._run_batch(inputs, batch, call)):
                    pieces[seg.item].append((seg.start, out))
            return [assemble(p) for p in pieces]
        finally:
            self.order.exit(stream)

    def _whole(self, inputs: Any, specs: tuple[Any, ...], reason: str) -> list[Any]:
        """Every item in one eager batch, as the model's own call would run them; while graphs
        are prepared, through the encoder's reference forward, which shares no state with them."""
        whole = Batch(tuple(Segment(i, 0, s.output_tokens) for i, s in enumerate(specs)), None,
                      sum(s.frames for s in specs))
        if reason == PREPARING:  # expected, not a fallback: counted, logged once at INFO
            with beside_captures():   # never while the preparation captures (capture._Gate)
                outs = split_rows(self.model.encoder_reference_forward(inputs),  # type: ignore
                                  whole.segments)
            self.stats.record_eager(len(specs), reason)
            self._log_once(f"vitgraph: answering calls eagerly while {reason}; until they "
                           "serve, other GPU work that synchronizes the device or draws random "
                           "numbers on it can raise (call wait_prepared() first)", logging.INFO)
        else:
            outs = self._eager(inputs, whole, reason)
        return [assemble([(0, out)]) for out in outs]

    def _background(self, inputs: Any) -> bool:
        """``capture="background"`` (under the lock): start preparing every budget's graphs on
        a thread when none is held; True if this call is to be answered beside it. Otherwise
        (graphs held or off, grad, no ``encoder_reference_forward``, no thread) the call goes
        the locked way, capturing inside it where graphs are missing."""
        if (self._graphs or not self.uses_cuda_graphs or self._grad_reason(inputs) is not None
                or not self.token_budgets):
            return False
        if not hasattr(self.model, "encoder_reference_forward"):
            self._log_once("vitgraph: capture='background' needs an encoder with "
                           "encoder_reference_forward(inputs); capturing in the call instead")
            return False
        if self._python_outside():
            return False
        self._generation += 1
        thread = threading.Thread(target=self._prepare,
                                  args=(self._generation, time.perf_counter()),
                                  name="vitgraph-prepare", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # no thread to start (the interpreter is exiting)
            self._log_once(f"vitgraph: capture='background' could not start its thread "
                           f"({error_line(exc)}); capturing in the call instead")
            return False
        self._preparer, self._preparing = thread, True
        _PREPARING.add(self)
        return True

    def _prepare(self, generation: int, start: float) -> None:
        """Capture every budget, largest first, into a new set, served under the lock once
        complete unless a later ``clear()`` cancelled it (its ``generation`` passed). A failure
        turns graphs off with the reason, never a call."""
        current = lambda: generation == self._generation  # noqa: E731
        outcomes: dict[int, CaptureOutcome] = {}
        failure = graphs = None
        try:
            graphs = self.graphs.fresh()
            with torch.cuda.device(self.device):
                for budget in sorted(self.token_budgets, reverse=True):
                    for _ in range(_CAPTURE_TRIES):
                        if not current():
                            break
                        outcomes[budget] = graphs.capture(budget, current)
                        if not _invalidated(outcomes[budget]):
                            break
                        log.info("vitgraph: budget %d's background capture was invalidated (%s; "
                                 "a device-wide synchronize elsewhere?): capturing it again",
                                 budget, outcomes[budget].skipped)
        except Exception as exc:  # a bug or the device: calls go on eagerly
            failure = f"preparing graphs in the background failed: {error_line(exc)}"
        while not self._lock.acquire(timeout=0.05):   # clear() may hold it, waiting for us
            if not current():
                return
        try:
            if not current():
                return
            if failure is not None:
                self.disable_graphs(failure)
            elif not self._python_outside():   # hooks or patches added meanwhile
                self.graphs, self._graphs = graphs, graphs.entries
                for budget, outcome in outcomes.items():
                    if outcome.skipped is not None:
                        try:   # warnings raised as errors (-W error) must not end the thread
                            self._disable_budget(budget, outcome.skipped,
                                                 warn=outcome.failed and not outcome.oom)
                        except Warning as exc:
                            log.warning("%s", exc)
                self.prepare_seconds = time.perf_counter() - start
                log.info("vitgraph: %d graphs prepared in the background in %.2f s; calls now "
                         "replay them", graphs.num_graphs, self.prepare_seconds)
        finally:
            if current():   # a cancelled one leaves the flag to its canceller
                self._preparing = False
            self._lock.release()

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """Wait for a background preparation to end; True once none runs (none started, or it
        was served, cancelled or failed: see ``memory_report()``), False if ``timeout`` passed."""
        thread = self._preparer
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self._lock:   # a canceller resets the flag under it, after its own join
            return not self._preparing

    def _stop_preparing(self, timeout: float | None = None) -> None:
        """Cancel a background preparation and wait for its capture in progress (under the lock:
        none can start meanwhile, and the preparation gives up waiting for the lock)."""
        thread = self._preparer
        if thread is None or thread is threading.current_thread():
            return
        self._generation += 1
        thread.join(timeout)
        if not thread.is_alive():
            self._preparer, self._preparing = None, False

    def _grad_reason(self, inputs: Any) -> str | None:
        if torch.is_grad_enabled() and needs_grad(self.model, inputs):
            return "grad required (graphs serve inference; use torch.no_grad())"
        return None

    def _run_batch(self, inputs: Any, batch: Batch, call: _Call) -> list[Any]:
        """The outputs of one planned batch, one per segment."""
        if batch.budget is None:
            return self._eager(inputs, batch, self.served.eager_reason(batch))
        if not self.pads:
            return self._unpadded(inputs, batch)
        if batch.budget in self.served.disabled:
            return self._eager(inputs, batch, self.served.disabled[batch.budget])
        try:
            outs = self._replay(inputs, batch, call)
        except InvalidInputError:  # the caller's input is wrong, not the graph: nothing disabled
            raise
        except torch.OutOfMemoryError as exc:  # no room for this call's copies: not the graph's
            return self._eager(inputs, batch, f"replay: {error_line(exc)}")
        except UnsupportedGraphError as exc:  # this batch only (e.g. more frames than captured)
            return self._eager(inputs, batch, f"batch not servable by graph: {exc}")
        except Exception as exc:  # a graph path must never crash a user's call
            why = f"replay failed: {error_line(exc)}"
            # eager first: if it raises too, the input is at fault and the budget stays served
            outs = self._eager(inputs, batch, why)
            self._disable_budget(batch.budget, why)
            return outs
        if outs is None:  # verification failed, budget now disabled
            return self._eager(inputs, batch, self.served.disabled[batch.budget])
        return outs

    def _unpadded(self, inputs: Any, batch: Batch) -> list[Any]:
        """A planned batch run at its own size without a graph (no CUDA device)."""
        out = self._eager_packed(inputs, batch)
        if self.exact_rows is None:
            self.stats.record_unpadded(len(batch.segments), batch.tokens)
        else:
            self.stats.record_exact(self.exact_rows, graph=False)
        return split_rows(out, batch.segments)

    def _replay(self, inputs: Any, batch: Batch, call: _Call) -> list[Any] | None:
        budget = batch.budget
        assert budget is not None
        entry = self._graphs.get(budget)
        if entry is None and not self._graphs and self._python_outside():
            return self._eager(inputs, batch, self._off_reason or "")
        if entry is None:
            if self.uses_cuda_graphs:
                self._capture_budget(budget)
                if budget in self.served.disabled:
                    return self._eager(inputs, batch, self.served.disabled[budget])
                entry = self._graphs[budget]
            else:
                entry = self.graphs.entry_without_graph(budget)
        buffers = self._replay_buffers(inputs, batch, budget)
        write_inputs(entry, buffers)
        graph = entry.graph is not None
        if graph:
            entry.graph.replay()
            # refresh weight copies once a call; if one was stale, replay again
            if self._refresh is not None and not call.refreshed:
                call.refreshed = True
                if self._refresh():
                    write_inputs(entry, buffers)
                    entry.graph.replay()
            out = entry.output
        else:
            with torch.no_grad():
                out = self.model.encoder_cudagraph_forward(entry.static)
        n = batch.tokens
        real = head_copy(out, n)
        if self.options.verify and not entry.verified:
            expected = map_output(self._eager_packed(inputs, batch), lambda t: t[:n])
            err, tol = max_rel_error(real, expected), verify_tolerance(self.options, self.dtype)
            if err > tol:
                self._disable_budget(
                    budget, f"verification failed: max relative error {err:.3g} > {tol:.3g}",
                    warn=True)
                return None
            entry.verified = True
            log.info("vitgraph: budget %d verified against eager (max relative error %.3g)",
                     budget, err)
        if self.exact_rows is None:
            self.stats.record_replay(budget, len(batch.segments), n, graph=graph)
        else:
            self.stats.record_exact(self.exact_rows, graph=graph)
        return split_rows(real, batch.segments)

    def _eager(self, inputs: Any, batch: Batch, reason: str) -> list[Any]:
        out = split_rows(self._eager_packed(inputs, batch), batch.segments)
        self.stats.record_eager(len(batch.segments), reason)
        # warn once per kind of reason (text before the first colon), then at DEBUG
        kind = reason.split(":")[0]
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("vitgraph: running a batch eagerly: %s (logged once per reason; counts "
                        "in stats)", reason)
        else:
            log.debug("vitgraph: eager batch of %d segments: %s", len(batch.segments), reason)
        return out

    def _eager_packed(self, inputs: Any, batch: Batch) -> Any:
        if self._segment_api:
            return self.model.encoder_eager_segments(inputs, batch.segments)  # type: ignore[attr-defined]
        return self.model.encoder_eager_forward(inputs, list(batch.items))

    def _replay_buffers(self, inputs: Any, batch: Batch, budget: int) -> Mapping[str, torch.Tensor]:
        if self._segment_api:
            return self.model.prepare_encoder_cudagraph_replay_segments(  # type: ignore[attr-defined]
                inputs, batch.segments, budget)
        return self.model.prepare_encoder_cudagraph_replay_buffers(inputs, list(batch.items), budget)

    def _python_outside(self) -> bool:
        """Whether the encoder runs Python graphs skip (hooks, patched code), turning them off."""
        outside = python_outside_graphs(self.watched) if self.watched is not None else None
        if outside is not None:
            self.disable_graphs(f"{outside}, Python that graphs skip; served eagerly (remove "
                                "it, then call refresh())")
        return outside is not None

    def _capture_budget(self, budget: int) -> None:
        with torch.cuda.device(self.device):  # the encoder's, whichever is current (graph_ms)
            outcome = self.graphs.capture(budget)
        if outcome.skipped is not None:
            # a non-memory capture failure also warns (host sync, an op graphs cannot hold)
            self._disable_budget(budget, outcome.skipped, warn=outcome.failed and not outcome.oom)

    def _disable_budget(self, budget: int, reason: str, warn: bool = False) -> None:
        self._graphs.pop(budget, None)
        if not self.served.disable(budget, reason):
            self._all_budgets_failed = True
            self.disable_graphs("every budget failed: " + reason)
        message = f"vitgraph: budget {budget} falls back to eager: {reason}"
        if warn:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        self._log_once(message)

    def _follow_moved_weights(self) -> None:
        # the graphs read the old addresses: capture again where that is still right
        assert self.watched is not None and self.weights is not None
        self.weights = WeightSlots(self.watched)
        here = {(self.device, self.dtype)}
        elsewhere = sorted(f"{d}, {t}" for d, t in self.weights.places() - here)
        if not elsewhere:
            log.warning("vitgraph: the encoder's weights have new storage since its graphs were "
                        "captured (.to(), assign=True, a replaced parameter); captured again")
            self.clear()
        else:
            self.disable_graphs(
                f"the encoder's weights moved ({'; '.join(elsewhere)}) after graphs were "
                f"captured for {self.device}, {self.dtype}; serve it again to have graphs there")

    def refresh(self) -> None:
        """Serve the encoder as it is now (after a replaced submodule, a hook added or removed,
        patched code): weights and hooks are read again, graphs captured again at the next call."""
        with self._lock:
            if self.watched is not None:
                self.weights = WeightSlots(self.watched)
            if self._off_reason is not None and not self._all_budgets_failed and (
                    "Python that graphs skip" in self._off_reason):
                self._off_reason = None
            self.clear()

    def _log_once(self, message: str, level: int = logging.WARNING) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.log(level, message)


#: Managers preparing in the background: the interpreter's exit waits for their capture in
#: progress (a thread cut off inside a capture can crash the exit).
_PREPARING: weakref.WeakSet[EncoderCudaGraphManager] = weakref.WeakSet()


@atexit.register
def _stop_all_preparing() -> None:
    for manager in list(_PREPARING):
        manager._stop_preparing(timeout=60.0)


#: Tries of a budget whose background capture was invalidated from outside (a device-wide
#: synchronize in another thread while it captured, which CUDA does not allow).
_CAPTURE_TRIES = 3


def _invalidated(outcome: CaptureOutcome) -> bool:
    return bool(outcome.failed and outcome.skipped and capture_broken(outcome.skipped))


class _Call:
    """One call's eager reason (``None``: graphs serve it) and whether weights were refreshed."""

    __slots__ = ("reason", "refreshed")

    def __init__(self, reason: str | None) -> None:
        self.reason, self.refreshed = reason, False


@functools.cache  # once per process
def _log_cpu_once() -> None:
    log.info("vitgraph: no CUDA device: each call runs eagerly, batch by batch as planned, at "
             "its own size (CUDA graphs, and the padding they need, want a CUDA device)")
