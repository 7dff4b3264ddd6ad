"""``capture._Gate``: stream captures and the calls answered beside a background preparation never
overlap (another thread's synchronize or random numbers would raise during a capture)."""

from __future__ import annotations

import threading
import time

from vit_graph_backend.runtime.capture import _Gate


def _until(predicate, limit=5.0):
    """Wait for another thread to reach a state (a sleep alone flakes on a loaded machine)."""
    end = time.perf_counter() + limit
    while not predicate() and time.perf_counter() < end:
        time.sleep(0.005)
    assert predicate()


def _started(target):
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_a_call_waits_for_a_running_capture_and_a_capture_for_a_call_in_flight():
    gate = _Gate()
    assert _second_after_first(gate.capture, gate.call) == ["first ends", "second"]
    assert _second_after_first(gate.call, gate.capture) == ["first ends", "second"]


def _second_after_first(first, second):
    """The order of events when ``second`` is entered from another thread while ``first`` is
    held here."""
    events = []
    with first():
        other = _started(lambda: _record(second, events, "second"))
        time.sleep(0.1)
        events.append("first ends")
    other.join(5)
    return events


def test_a_waiting_capture_goes_before_new_calls():
    gate, events = _Gate(), []
    first = gate.call()
    first.__enter__()
    capturer = _started(lambda: _record(gate.capture, events, "capture"))
    _until(lambda: gate._waiting == 1)
    caller = _started(lambda: _record(gate.call, events, "second call"))
    time.sleep(0.1)
    assert events == []          # the capture waits for the first call, the second for it
    first.__exit__(None, None, None)
    capturer.join(5)
    caller.join(5)
    assert events == ["capture", "second call"]


def test_a_capture_inside_the_threads_own_call_does_not_wait_for_it():
    gate, done = _Gate(), []

    def nested():
        with gate.call(), gate.capture():   # a kernel timing inside a call's compile
            done.append(True)

    thread = _started(nested)
    thread.join(5)
    assert done == [True]


def _record(context, events, name):
    with context():
        events.append(name)


def test_a_capture_waits_for_a_call_at_most_the_gate_time(monkeypatch, caplog):
    """A call that never leaves (it waits on something the capturing thread holds) delays the
    capture by at most ``GATE_WAIT_S``, with a warning, instead of hanging both."""
    from vit_graph_backend.runtime import capture

    monkeypatch.setattr(capture, "GATE_WAIT_S", 0.2)
    gate = _Gate()
    with gate.call():
        done = []
        capturer = _started(lambda: _record(gate.capture, done, "capture"))
        capturer.join(5)
    assert done == ["capture"]
    assert "has not returned" in caplog.text


def test_an_interrupted_wait_leaves_the_gate_open(monkeypatch):
    """An exception while a capture waits (Ctrl-C) gives back what it took: later calls enter."""
    gate = _Gate()

    def interrupted(predicate, timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(gate._cond, "wait_for", interrupted)
    try:
        with gate.capture():
            pass
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    entered = []
    caller = _started(lambda: _record(gate.call, entered, "call"))
    caller.join(5)
    assert entered == ["call"]


def test_a_call_inside_a_call_does_not_wait_behind_a_waiting_capture():
    """One encoder called inside another's forward: the inner call is already in, so a capture
    waiting for the outer one must not hold it up (it would wait out GATE_WAIT_S)."""
    gate, events = _Gate(), []
    outer = gate.call()
    outer.__enter__()
    capturer = _started(lambda: _record(gate.capture, events, "capture"))
    _until(lambda: gate._waiting == 1)   # the capture waits for the outer call
    start = time.perf_counter()
    with gate.call():
        events.append("inner call")
    assert time.perf_counter() - start < 1.0
    outer.__exit__(None, None, None)
    capturer.join(5)
    assert events == ["inner call", "capture"]
