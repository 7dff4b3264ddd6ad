"""``capture="background"`` on CPU: calls answered by the encoder's reference forward while a
thread prepares the graphs, then served from them; cancelled by ``clear()``; a failed
preparation turns graphs off without failing a call. Captures are replaced by static buffers
only (no CUDA here) behind a gate the test opens; ``tests/gpu/test_background_gpu.py`` captures
real graphs, ``tests/stress`` (part ``switch``) switches under four threads."""

from __future__ import annotations

import contextlib
import logging
import threading

import pytest
import torch

from toy_encoders import PaddedSegToyEncoder, run_alone
from vit_graph_backend.errors import InvalidOptionError
from vit_graph_backend.options import VitGraphOptions
from vit_graph_backend.runtime import manager as manager_module
from vit_graph_backend.runtime.capture import BudgetGraphs, CaptureOutcome
from vit_graph_backend.runtime.manager import PREPARING, EncoderCudaGraphManager

MBS = 4


class ReferenceToy(PaddedSegToyEncoder):
    """The toy with a reference forward: every item of the call, in the plain model."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reference_threads: list[str] = []

    def encoder_reference_forward(self, inputs):
        self.reference_threads.append(threading.current_thread().name)
        return self.encoder_eager_forward(inputs, range(len(inputs["lengths"])))


class Gate:
    """Stands in for a budget's capture: waits until opened, then makes its static buffers."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.captured: list[int] = []
        self.threads: set[str] = set()
        self.fail: Exception | None = None

    def __call__(self, graphs: BudgetGraphs, budget: int) -> CaptureOutcome:
        self.threads.add(threading.current_thread().name)
        assert self.opened.wait(10), "the test never opened the gate"
        if self.fail is not None:
            raise self.fail
        graphs.entry_without_graph(budget)
        self.captured.append(budget)
        return CaptureOutcome()


@pytest.fixture
def gate(monkeypatch):
    """Managers made in the test take the graph path on CPU, their captures behind a gate."""
    gate = Gate()
    monkeypatch.setattr(EncoderCudaGraphManager, "uses_cuda_graphs",
                        property(lambda self: self._off_reason is None))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(BudgetGraphs, "capture",
                        lambda graphs, budget, wanted=None: gate(graphs, budget))
    return gate


def _manager(model=None, **options):
    torch.manual_seed(0)
    model = model or ReferenceToy(dim=8, budget_range=(8, 64), max_batch_size=MBS).eval()
    options = {"max_items_per_graph": MBS, "capture": "background", **options}
    return model, EncoderCudaGraphManager(model, VitGraphOptions(**options),
                                          pad_without_graphs=True)


def _call(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(sum(lengths), 8, generator=g), "lengths": list(lengths)}


def _check(model, mgr, lengths, seed=0):
    inputs = _call(lengths, seed)
    for got, want in zip(mgr.run(inputs), run_alone(model, inputs)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _skipping(monkeypatch, gate, skipped_budget, outcome):
    """Captures behind ``gate``, but ``skipped_budget`` comes back as ``outcome``."""
    monkeypatch.setattr(BudgetGraphs, "capture", lambda graphs, budget, wanted=None: (
        outcome if budget == skipped_budget else gate(graphs, budget)))
    gate.opened.set()


def _finish(mgr):
    mgr._preparer.join(10)
    assert not mgr._preparer.is_alive()


@torch.no_grad()
def test_calls_are_answered_while_graphs_are_prepared_then_served_from_them(gate):
    model, mgr = _manager()
    _check(model, mgr, [5, 17])              # starts the preparation, answered at once
    _check(model, mgr, [40], seed=1)
    assert mgr.memory_report()["preparing"] is True
    assert mgr.stats.fallback_reasons == {PREPARING: 2}
    assert mgr.stats.eager_items == 3 and mgr.num_graphs == 0 and not mgr.graphs.entries
    assert model.reference_threads == ["MainThread", "MainThread"]
    assert gate.threads == {"vitgraph-prepare"}
    gate.opened.set()
    _finish(mgr)
    report = mgr.memory_report()
    assert report["preparing"] is False and report["prepare_seconds"] > 0
    assert sorted(gate.captured, reverse=True) == gate.captured   # largest first
    assert set(gate.captured) == set(mgr.token_budgets)
    _check(model, mgr, [5, 17], seed=2)
    _check(model, mgr, [64, 3], seed=3)
    stats = mgr.stats
    assert stats.fallback_reasons == {PREPARING: 2}            # nothing new ran eagerly
    assert stats.no_graph_items == 4 and stats.padded_tokens > 0   # the padded graph path
    assert model.reference_threads == ["MainThread", "MainThread"]


@torch.no_grad()
def test_clear_cancels_a_preparation_and_the_next_call_starts_another(gate):
    model, mgr = _manager()
    _check(model, mgr, [9])
    first = mgr._preparer
    done = threading.Event()
    clearing = threading.Thread(target=lambda: (mgr.clear(), done.set()))
    clearing.start()
    assert not done.wait(0.3)     # clear() waits for the capture in progress
    gate.opened.set()
    clearing.join(10)
    assert done.is_set() and not first.is_alive()
    assert not mgr.graphs.entries and mgr.memory_report()["preparing"] is False
    assert gate.captured == [max(mgr.token_budgets)]   # it stopped after the one in progress
    _check(model, mgr, [9], seed=1)                    # a new preparation
    _finish(mgr)
    assert mgr._preparer is not first and mgr.num_graphs == 0 and len(mgr.graphs.entries) == len(
        mgr.token_budgets)


@torch.no_grad()
def test_a_failed_preparation_turns_graphs_off_and_calls_stay_right(gate, caplog):
    model, mgr = _manager()
    gate.fail = RuntimeError("CUDA error: an illegal instruction")
    _check(model, mgr, [12, 3])
    with caplog.at_level(logging.WARNING, logger=manager_module.__name__):
        gate.opened.set()
        _finish(mgr)
    reason = mgr.memory_report()["graphs_off_reason"]
    assert "preparing graphs in the background failed: RuntimeError: CUDA error" in reason
    assert reason in caplog.text
    _check(model, mgr, [12, 3], seed=1)
    assert mgr.stats.fallback_reasons[reason] == 1


@torch.no_grad()
def test_skipped_budgets_are_disabled_when_the_prepared_set_is_served(gate, monkeypatch):
    model, mgr = _manager()
    largest = max(mgr.token_budgets)
    _skipping(monkeypatch, gate, largest,
              CaptureOutcome(skipped="needs about 9 MiB, over max_graph_memory"))
    _check(model, mgr, [3])
    _finish(mgr)
    assert largest not in mgr.token_budgets
    assert "over max_graph_memory" in mgr.memory_report()["disabled_budgets"][largest]
    _check(model, mgr, [60], seed=1)   # past the largest budget left: eager, counted
    assert mgr.stats.eager_items == 2


@torch.no_grad()
def test_an_encoder_without_a_reference_forward_captures_in_the_call(gate, caplog):
    model = PaddedSegToyEncoder(dim=8, budget_range=(8, 64), max_batch_size=MBS).eval()
    model, mgr = _manager(model)
    gate.opened.set()
    with caplog.at_level(logging.WARNING, logger=manager_module.__name__):
        _check(model, mgr, [7])
    assert "needs an encoder with encoder_reference_forward" in caplog.text
    assert mgr._preparer is None and len(gate.captured) == len(mgr.token_budgets)
    assert gate.threads == {"MainThread"}


@torch.no_grad()
def test_threads_calling_through_the_switch_all_get_eager_s_answer(gate):
    model, mgr = _manager()
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    @torch.no_grad()   # grad mode is per thread
    def worker(w: int) -> None:
        try:
            barrier.wait()
            for k in range(30):
                if w == 0 and k == 10:
                    gate.opened.set()       # the switch happens while the others call
                _check(model, mgr, [1 + (w * 7 + k) % 60, 2 + k % 5], seed=w * 100 + k)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    _finish(mgr)
    stats = mgr.stats
    assert stats.calls == 120
    assert stats.fallback_reasons[PREPARING] >= 1 and stats.no_graph_items > 0


def test_background_capture_refuses_batch_invariance():
    with pytest.raises(InvalidOptionError,
                       match=r"capture='background' is invalid with batch_invariant=True"):
        VitGraphOptions(capture="background", batch_invariant=True)


@torch.no_grad()
def test_the_interpreter_exit_waits_for_a_capture_in_progress(gate):
    model, mgr = _manager()
    _check(model, mgr, [4])
    threading.Timer(0.2, gate.opened.set).start()
    manager_module._stop_all_preparing()          # the atexit hook
    assert not mgr._preparing and mgr._preparer is None
    assert gate.captured == [max(mgr.token_budgets)] and not mgr.graphs.entries


@torch.no_grad()
def test_a_failed_budget_is_logged_when_warnings_are_errors(gate, monkeypatch, caplog):
    """``-W error`` turns the failed budget's RuntimeWarning into an exception: the prepared set
    is served anyway and the warning is logged, not raised in the preparation's thread."""
    import warnings

    model, mgr = _manager()
    smallest = min(mgr.token_budgets)
    _skipping(monkeypatch, gate, smallest,
              CaptureOutcome(skipped="capture failed: a host sync", failed=True))
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING,
                                                    logger=manager_module.__name__):
        warnings.simplefilter("error")
        _check(model, mgr, [3])
        _finish(mgr)
    assert smallest not in mgr.token_budgets and mgr.memory_report()["preparing"] is False
    assert len(mgr.graphs.entries) == len(mgr.token_budgets)
    assert f"budget {smallest} falls back to eager: capture failed: a host sync" in caplog.text


@torch.no_grad()
def test_a_thread_that_cannot_start_leaves_the_call_to_capture(gate, monkeypatch, caplog):
    model, mgr = _manager()

    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    gate.opened.set()
    with caplog.at_level(logging.WARNING, logger=manager_module.__name__):
        _check(model, mgr, [6, 2])
    assert "could not start its thread" in caplog.text
    assert not mgr._preparing and len(mgr.graphs.entries) == len(mgr.token_budgets)
    assert mgr.stats.no_graph_items == 2 and not mgr.stats.fallback_reasons


@torch.no_grad()
def test_first_calls_arriving_together_start_one_preparation(gate):
    model, mgr = _manager()
    results: list[BaseException | None] = []

    @torch.no_grad()
    def call(seed: int) -> None:
        try:
            _check(model, mgr, [3 + seed, 5], seed=seed)
            results.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results.append(exc)

    with mgr._lock:   # both wait for the lock, having found no preparation
        threads = [threading.Thread(target=call, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        while sum(t.is_alive() for t in threads) < 3:
            pass
    for t in threads:
        t.join(10)
    assert results == [None, None, None]
    assert mgr._generation == 1 and mgr.stats.fallback_reasons == {PREPARING: 3}
    gate.opened.set()
    assert mgr.wait_prepared(10)
    assert len(mgr.graphs.entries) == len(mgr.token_budgets)


@torch.no_grad()
def test_wait_prepared_times_out_while_the_capture_waits(gate):
    model, mgr = _manager()
    assert mgr.wait_prepared(0.01)            # nothing started: nothing to wait for
    _check(model, mgr, [8])
    assert mgr.wait_prepared(0.05) is False and mgr.memory_report()["preparing"] is True
    gate.opened.set()
    assert mgr.wait_prepared(10) is True and mgr.num_graphs == 0
    assert len(mgr.graphs.entries) == len(mgr.token_budgets)


@torch.no_grad()
def test_capture_while_preparing_cancels_it_and_captures_in_the_caller(gate):
    model, mgr = _manager()
    _check(model, mgr, [8])
    preparer = mgr._preparer
    capturing = threading.Thread(target=mgr.capture, name="capturer")
    capturing.start()
    capturing.join(0.2)
    assert capturing.is_alive()      # waiting for the capture in progress
    gate.opened.set()
    capturing.join(10)
    assert not capturing.is_alive() and not preparer.is_alive()
    assert mgr._preparer is None and mgr.memory_report()["preparing"] is False
    assert gate.threads == {"vitgraph-prepare", "capturer"}
    assert len(mgr.graphs.entries) == len(mgr.token_budgets)
    assert gate.captured.count(max(mgr.token_budgets)) == 2   # the cancelled one, then capture()
    _check(model, mgr, [8], seed=1)
    assert mgr.stats.no_graph_items == 1


def test_a_timing_capture_broken_from_outside_is_not_held_against_the_kernel():
    """CUDA refuses a device-wide synchronize while another thread captures; a kernel timing
    broken that way is reported as the moment's failure (tried again later), like memory."""
    from vit_graph_backend.runtime.timing import time_each

    def timer(fn, calls, reps):
        fn()
        return 1.0

    def run(candidate):
        if candidate == "broken":
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        if candidate == "bad":
            raise RuntimeError("triton: out of resources: shared memory")

    times, failures = time_each(["ok", "broken", "bad"], run, calls=1, reps=1, timer=timer)
    assert times == {"ok": 1.0}
    assert failures["broken"][1] is True and failures["bad"][1] is False


def test_the_capture_lock_is_one_for_every_device():
    """Emptying the allocator's caches acts on every device: no device captures beside it."""
    from vit_graph_backend.runtime.capture import capture_lock

    assert capture_lock(torch.device("cuda", 0)) is capture_lock(torch.device("cuda", 1))
    assert capture_lock(torch.device("cpu")) is capture_lock(torch.device("cuda", 0))
