"""Capturing one budget's CUDA graph within a memory bound, and surviving a capture that fails.

:func:`capture_budget_graph` warms the budget up on a side stream (the memory reserved is its
estimate), checks ``max_graph_memory`` against the graphs held plus what the pool cannot already
supply, and captures into the shared pool with ``keep_graph=True`` (``launch.py`` instantiates
it). A graph found over the bound after capture is dropped. A failed capture can leave its pool
unusable, so the caller continues in a fresh pool. Budgets go largest first, so under memory
pressure the small ones that fit are kept.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _compat
from ..errors import error_line, out_of_memory
from .launch import capture_stream, device_index, launch_kind, make_launcher
from .replay_io import output_tensors

__all__ = ["BudgetGraph", "BudgetGraphs", "CaptureOutcome", "GraphMemory", "beside_captures",
           "capture_broken", "capture_budget_graph", "capture_lock", "capturing",
           "close_failed_capture", "mib", "storage_bytes"]

log = logging.getLogger(__name__)

_CAPTURE_LOCK = threading.RLock()


def capture_lock(device: torch.device) -> threading.RLock:
    """The lock a capture on ``device`` holds, and whatever must not run beside one: every graph
    of a device is captured on one stream (``launch.capture_stream``); ``torch.cuda.graph``
    synchronizes the device and empties the allocator's caches as it begins, which CUDA and
    PyTorch refuse while another thread captures; a background preparation (``manager.py``)
    captures outside the stream order that serializes the captures made inside calls. Kernel
    timings (``timing.graph_ms``) and ``clear()``'s synchronize take it too. One lock for every
    device: emptying the caches acts on all of them."""
    return _CAPTURE_LOCK


#: Seconds a capture waits for the calls answered beside a background preparation.
GATE_WAIT_S = 60.0


class _Gate:
    """Stream captures and the calls answered beside a background preparation, kept apart.

    While a thread captures, CUDA refuses a device-wide synchronize from any other thread, and
    PyTorch puts the device's default random generator in capture mode, so another thread's
    random numbers on it raise. A call answered by the model's own forward beside a background
    preparation (``manager.py``) can do either (an allocator emptying its cache, a compile that
    times kernels): such calls wait while a capture runs, and a capture waits for other threads'
    calls in flight (a call's own kernel timings capture inside it); waiting captures go first,
    so a stream of calls cannot starve them. A capture waits at most :data:`GATE_WAIT_S` for the
    calls, so a call that waits on something the capturing thread holds delays it, never hangs.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._captures = self._waiting = self._calls = 0
        self._mine = threading.local()

    def _own(self) -> int:
        return getattr(self._mine, "calls", 0)

    @contextmanager
    def capture(self) -> Iterator[None]:
        own = self._own()
        with self._cond:
            self._waiting += 1
            try:
                drained = self._cond.wait_for(lambda: self._calls == own, timeout=GATE_WAIT_S)
            finally:   # an interrupted wait too: calls wait for no capture that never came
                self._waiting -= 1
                self._cond.notify_all()
            self._captures += 1
        try:
            if not drained:
                log.warning("vitgraph: capturing beside a call answered during the background "
                            "preparation that has not returned in %.0f s", GATE_WAIT_S)
            yield
        finally:
            with self._cond:
                self._captures -= 1
                self._cond.notify_all()

    @contextmanager
    def call(self) -> Iterator[None]:
        own = self._own()
        with self._cond:
            if not own:   # a call inside a call (one encoder inside another's) is already in
                self._cond.wait_for(lambda: self._captures == 0 and self._waiting == 0)
            self._calls += 1
        self._mine.calls = own + 1
        try:
            yield
        finally:
            self._mine.calls = own
            with self._cond:
                self._calls -= 1
                self._cond.notify_all()


_GATE = _Gate()
#: Held around a stream capture (``torch.cuda.graph``, ``capture_begin``..``capture_end``).
capturing = _GATE.capture
#: Held by a call answered beside a background preparation (:class:`_Gate`).
beside_captures = _GATE.call


def close_failed_capture(pool: Any, device: torch.device) -> None:
    """Close what a capture that raised left open: the allocator still recording into ``pool``
    (``_compat.end_failed_capture``) and the device's default random generator in capture mode
    (``capture_end`` raised before closing it, and every later random number on the device
    would raise "Offset increment outside graph capture"), which an empty capture opens and
    closes again."""
    _compat.end_failed_capture(pool, device)
    graph = torch.cuda.CUDAGraph()
    with capturing(), torch.cuda.device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "The CUDA Graph is empty"
        try:
            with torch.cuda.graph(graph, stream=capture_stream(device),
                                  capture_error_mode="thread_local"):
                pass
        except RuntimeError:  # nothing more to do: the next capture settles it
            pass


def capture_broken(text: str) -> bool:
    """Whether an error's ``text`` is CUDA refusing or invalidating a capture (not the fault of
    what was captured): a budget's capture is taken again, a kernel timing tried later."""
    return "when stream is capturing" in text or "during capture" in text


def mib(n: int | None) -> str:
    """``n`` bytes as MiB for messages."""
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


@dataclass
class GraphMemory:
    """Memory held by one manager's graphs: pools, static inputs, the bound, estimates."""

    limit_option: int | float | None = None
    limit: int | None = None
    pools: list[Any] = field(default_factory=list)
    estimates: dict[int, int] = field(default_factory=dict)

    def resolve_limit(self, device: torch.device, held: int) -> int | None:
        """The byte bound, resolved once at the first capture: an int is bytes; a float is a
        fraction of the device's free memory then, plus what these graphs already hold. Free
        memory is read after emptying the cache, so blocks cached by earlier calls or kernel
        timings do not lower the bound."""
        if self.limit is None and self.limit_option is not None:
            if isinstance(self.limit_option, float):
                torch.cuda.empty_cache()
                free, _ = torch.cuda.mem_get_info(device)
                self.limit = int(self.limit_option * (free + held))
            else:
                self.limit = int(self.limit_option)
        return self.limit

    def pool_bytes(self, device: torch.device) -> int:
        """Bytes the allocator reserved for every pool these graphs were captured into."""
        return sum(_compat.graph_pool_bytes(pool, device) or 0 for pool in self.pools)

    def clear(self) -> None:
        """Forget pools and estimates (the bound stays resolved)."""
        self.pools.clear()
        self.estimates.clear()


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the storages behind ``tensors``, each counted once (across calls too: ``seen``)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


@dataclass
class CaptureOutcome:
    """A captured graph and its static output, or the reason the budget was skipped."""

    graph: Any = None
    output: Any = None
    skipped: str | None = None
    failed: bool = False          # the capture itself failed: continue in a fresh pool
    oom: bool = False             # skipped because memory ran out (pressure, not a bug)


def _warmup(forward: Callable[[Any], Any], static: Mapping[str, torch.Tensor],
            iters: int, device: torch.device) -> tuple[int | None, bool | None]:
    """Bytes the warm-up reserved and whether it advanced the device RNG (``None``s without one)."""
    if iters == 0:
        return None, None
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    generator = torch.cuda.default_generators[device_index(device)]
    offset = generator.get_offset()
    current = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(iters):
            forward(static)
    current.wait_stream(stream)
    return (max(0, torch.cuda.memory_reserved(device) - before),
            generator.get_offset() != offset)


def capture_budget_graph(
    budget: int, forward: Callable[[Any], Any], static: Mapping[str, torch.Tensor], *,
    pool: Any, device: torch.device, warmup_iters: int, memory: GraphMemory,
    held: int, new_static: int, live_outputs: int = 0, graph_launch: str = "auto",
) -> CaptureOutcome:
    """Warm up, check the bound, capture; never raises for a budget that cannot be captured.

    Args:
        held: bytes the manager's graphs hold now (pools and static inputs).
        new_static: bytes of this budget's static inputs not yet counted in ``held``.
        live_outputs: bytes of static outputs of graphs already captured (not reusable).
        graph_launch: the option of that name (``launch.py``).
    """
    # resolved before the warm-up, whose cached memory would read as not free
    limit = memory.resolve_limit(device, held)
    try:
        estimate, uses_rng = _warmup(forward, static, warmup_iters, device)
    except Exception as exc:  # memory (errors.out_of_memory) skips the budget; the rest raise
        if not out_of_memory(exc):
            raise
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        return CaptureOutcome(skipped=f"warm-up: {error_line(exc)}; {mib(free)} free after it",
                              oom=True)
    if estimate is not None:
        memory.estimates[budget] = estimate
    if limit is not None and estimate is not None:
        reusable = max(0, (_compat.graph_pool_bytes(pool, device) or 0) - live_outputs)
        projected = held + new_static + max(0, estimate - reusable)
        if projected > limit:
            return CaptureOutcome(skipped=(
                f"needs about {mib(projected)} with the graphs already held, over "
                f"max_graph_memory={memory.limit_option!r} ({mib(limit)})"))
    stream_before = torch.cuda.current_stream(device)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    try:
        with capturing():   # with the clean-up: calls beside it wait for the settled generator
            try:
                with torch.no_grad(), torch.cuda.graph(graph, pool=pool,
                                                       stream=capture_stream(device),
                                                       capture_error_mode="thread_local"):
                    output = forward(static)
            except Exception:
                torch.cuda.set_stream(stream_before)
                close_failed_capture(pool, device)
                raise
    except Exception as exc:  # e.g. out of memory, a host sync or CPU op in the forward
        del graph
        torch.cuda.empty_cache()
        return CaptureOutcome(failed=True, oom=out_of_memory(exc),
                              skipped=f"capture failed: {error_line(exc)}")
    try:
        launcher = make_launcher(graph, device, graph_launch, uses_rng)
    except Exception as exc:  # PyTorch's own instantiation failed: the graph cannot run
        del graph
        return CaptureOutcome(failed=True, skipped=f"instantiation failed: {error_line(exc)}")
    return CaptureOutcome(graph=launcher, output=output)


@dataclass
class BudgetGraph:
    """One budget's static buffers, its graph (``None`` without CUDA) and its static output."""

    budget: int
    static: dict[str, torch.Tensor]
    graph: Any = None
    output: Any = None
    verified: bool = False
    #: static buffers a replay rewrites (the rest are capture-time constants)
    written: set[str] = field(default_factory=set)
    #: the ``StampedBuffers.stamp`` the static buffers were last filled from (``replay_io``)
    stamp: Any = None
    #: per static buffer, how many leading rows may be non-zero (absent: all of them)
    dirty: dict[str, int] = field(default_factory=dict)
    _aliased: frozenset[str] | None = field(default=None, init=False, repr=False)

    def forget_inputs(self) -> None:
        """The static buffers were written outside a replay: the next one writes them all."""
        self.stamp = None
        self.dirty.clear()

    def aliased_keys(self) -> frozenset[str]:
        """Static buffers sharing storage with another one (in any budget): their non-zero rows
        are not tracked. Set by :class:`BudgetGraphs`; an entry made alone checks its own."""
        if self._aliased is None:
            self._aliased = _aliased({self.budget: self})[self.budget]
        return self._aliased


def _aliased(entries: Mapping[int, BudgetGraph]) -> dict[int, frozenset[str]]:
    """Per budget, its static buffers whose storage another static buffer of ``entries`` uses."""
    users: dict[int, int] = {}
    for entry in entries.values():
        for tensor in entry.static.values():
            ptr = tensor.untyped_storage().data_ptr()
            users[ptr] = users.get(ptr, 0) + 1
    return {budget: frozenset(key for key, t in entry.static.items()
                              if users[t.untyped_storage().data_ptr()] > 1)
            for budget, entry in entries.items()}


class BudgetGraphs:
    """The captured graphs of one manager (static buffers, pools, memory book, skips); the
    manager decides what to serve, this class builds, holds and frees graphs."""

    def __init__(self, model: Any, warmup_iters: int, max_graph_memory: int | float | None,
                 max_batch_size: int, max_frames_per_batch: int | None,
                 device: torch.device, dtype: torch.dtype, graph_launch: str = "auto") -> None:
        self.model = model
        self.graph_launch = graph_launch
        self.warmup_iters = warmup_iters
        self.slots = (max_batch_size, max_frames_per_batch)
        self.device, self.dtype = device, dtype
        self.entries: dict[int, BudgetGraph] = {}
        self.graph_pool: Any = None
        self.memory = GraphMemory(max_graph_memory)
        self.skipped: dict[int, str] = {}
        #: budgets skipped because memory ran out, over this manager's life
        self.out_of_memory = 0
        self.capture_seconds = 0.0

    @property
    def num_graphs(self) -> int:
        """Graphs captured now."""
        return sum(1 for g in self.entries.values() if g.graph is not None)

    def _static_tensors(self) -> Iterable[torch.Tensor]:
        return (t for g in self.entries.values() for t in g.static.values())

    def pool_bytes(self) -> int:
        """Bytes reserved for the pools these graphs live in (0 off CUDA)."""
        return self.memory.pool_bytes(self.device) if self.device.type == "cuda" else 0

    def report(self) -> dict[str, Any]:
        """The memory part of the manager's ``memory_report()``."""
        static = storage_bytes(self._static_tensors())
        pool = self.pool_bytes()
        # without a captured graph (no CUDA) static buffers count as inputs, not graph memory
        graphed = storage_bytes(t for g in self.entries.values() if g.graph is not None
                                for t in g.static.values())
        return {
            "graphs": self.num_graphs,
            "captured_budgets": sorted(b for b, g in self.entries.items() if g.graph is not None),
            "graph_launch": {b: launch_kind(g.graph) for b, g in sorted(self.entries.items())
                             if g.graph is not None},
            "largest_budget": max(self.entries) if self.entries else None,
            "pool_bytes": pool,
            "static_input_bytes": static,
            "total_bytes": pool + graphed,
            "max_graph_memory_bytes": self.memory.limit,
            "estimated_bytes": dict(sorted(self.memory.estimates.items())),
            "capture_seconds": round(self.capture_seconds, 4),
            "skipped_budgets": dict(sorted(self.skipped.items())),
            "out_of_memory_skips": self.out_of_memory,
        }

    def capture_inputs(self, budget: int) -> dict[str, torch.Tensor]:
        """The model's static buffers for ``budget``, sized for every graph slot."""
        return dict(self.model.prepare_encoder_cudagraph_capture_inputs(
            budget, *self.slots, self.device, self.dtype))

    def entry_without_graph(self, budget: int) -> BudgetGraph:
        """Static buffers only: the path a device without CUDA runs."""
        entry = self.entries.get(budget)
        if entry is None:
            entry = self.entries[budget] = BudgetGraph(budget, self.capture_inputs(budget))
            self._mark_aliases()
        return entry

    def _mark_aliases(self) -> None:
        """After a budget joins: which static buffers share storage, over all budgets."""
        for budget, keys in _aliased(self.entries).items():
            self.entries[budget]._aliased = keys

    def capture(self, budget: int, wanted: Callable[[], bool] | None = None) -> CaptureOutcome:
        """Capture ``budget`` into the shared pool, measured and bounded; skips go to
        :attr:`skipped`. ``wanted``: asked under the capture lock; False skips the capture."""
        with capture_lock(self.device):
            if wanted is not None and not wanted():
                return CaptureOutcome(skipped="cancelled")
            start = time.perf_counter()
            try:
                outcome = self._capture(budget)
            finally:
                self.capture_seconds += time.perf_counter() - start
        if outcome.failed:
            # the pool may be unusable for later captures
            self.graph_pool = torch.cuda.graph_pool_handle()
        if outcome.skipped is not None:
            self.skipped[budget] = outcome.skipped
            self.out_of_memory += outcome.oom
        return outcome

    def _capture(self, budget: int) -> CaptureOutcome:
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        if self.graph_pool not in self.memory.pools:
            self.memory.pools.append(self.graph_pool)
        held_storages: set[int] = set()
        held = self.pool_bytes() + storage_bytes(self._static_tensors(), held_storages)
        try:
            static = self.capture_inputs(budget)
        except Exception as exc:  # as the warm-up: memory skips, the rest raise
            if not out_of_memory(exc):
                raise
            torch.cuda.empty_cache()
            return CaptureOutcome(skipped=f"static inputs: {error_line(exc)}", oom=True)
        outcome = capture_budget_graph(
            budget, self.model.encoder_cudagraph_forward, static, pool=self.graph_pool,
            device=self.device, warmup_iters=self.warmup_iters, memory=self.memory, held=held,
            new_static=storage_bytes(static.values(), held_storages),
            live_outputs=storage_bytes(t for g in self.entries.values() if g.output is not None
                                       for t in output_tensors(g.output)),
            graph_launch=self.graph_launch)
        if outcome.skipped is None:
            self.entries[budget] = BudgetGraph(budget, static, outcome.graph, outcome.output)
            limit = self.memory.limit
            total = self.pool_bytes() + storage_bytes(self._static_tensors())
            if limit is not None and total > limit:
                # the estimate was short: the bound is a promise, so this graph goes again
                del self.entries[budget]
                del outcome, static
                if not self.entries:
                    # no other graph lives in this pool: drop it so its memory goes
                    self.memory.pools.remove(self.graph_pool)
                    self.graph_pool = None
                torch.cuda.empty_cache()
                return CaptureOutcome(skipped=(
                    f"captured at {mib(total)} with the graphs already held, over "
                    f"max_graph_memory={self.memory.limit_option!r} ({mib(limit)})"))
            self._mark_aliases()
        return outcome

    def fresh(self) -> BudgetGraphs:
        """An empty set with the same settings and a pool of its own (a background preparation
        fills it, then it replaces this one; a shared pool could lose its last graph before)."""
        return BudgetGraphs(self.model, self.warmup_iters, self.memory.limit_option,
                            *self.slots, self.device, self.dtype, self.graph_launch)

    def clear(self) -> None:
        """Drop graphs, buffers, pools and skips (the caller has ordered the GPU first)."""
        self.entries.clear()
        self.graph_pool = None
        self.memory.clear()
        self.skipped.clear()
