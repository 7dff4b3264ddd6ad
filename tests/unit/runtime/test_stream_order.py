"""`StreamOrder`: each call's GPU work ordered after the previous call's, whatever its stream.

The GPU behaviour is exercised in ``tests/gpu/test_concurrency_gpu.py``; here the protocol is
checked on CPU against stand-in streams and events that record what was asked of them, and the
lock against real threads.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from vit_graph_backend.runtime import stream_order
from vit_graph_backend.runtime.stream_order import StreamOrder, order_for


class _Event:
    def __init__(self, log):
        self.log, self.recorded_on = log, None

    def record(self, stream):
        self.recorded_on = stream.name
        self.log.append(("record", stream.name))


class _Stream:
    def __init__(self, name, log):
        self.name, self.log, self.cuda_stream = name, log, hash(name)

    def wait_event(self, event):
        self.log.append(("wait", self.name, event.recorded_on))


@pytest.fixture
def fake_cuda(monkeypatch):
    log: list = []
    streams = {"s1": _Stream("s1", log), "s2": _Stream("s2", log)}
    current = {"name": "s1"}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams[current["name"]])
    # the raw handle of the current stream (a CUDA build of torch on a machine without a GPU
    # has the binding, and calling it fails)
    monkeypatch.setattr(stream_order, "current_raw_stream",
                        lambda index: streams[current["name"]].cuda_stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda: _Event(log))
    return log, current


def test_same_stream_never_waits_another_stream_waits_for_the_last_call(fake_cuda):
    log, current = fake_cuda
    order = StreamOrder(torch.device("cuda", 0))
    for name in ("s1", "s1", "s2", "s2", "s1"):
        current["name"] = name
        stream = order.enter()
        log.append(("work", name))
        order.exit(stream)
    # an event is recorded only when the stream changes, on the previous call's stream
    assert log == [
        ("work", "s1"),
        ("work", "s1"),
        ("record", "s1"), ("wait", "s2", "s1"), ("work", "s2"),
        ("work", "s2"),
        ("record", "s2"), ("wait", "s1", "s2"), ("work", "s1"),
    ]
    assert order.cross_stream_waits == 2


def test_exit_records_even_when_the_call_raised(fake_cuda):
    log, current = fake_cuda
    order = StreamOrder(torch.device("cuda", 0))
    with pytest.raises(RuntimeError):
        with order:
            raise RuntimeError("replay failed")
    current["name"] = "s2"
    with order:
        pass
    assert ("wait", "s2", "s1") in log


def test_nested_use_in_one_thread_does_not_deadlock_or_wait_twice(fake_cuda):
    log, current = fake_cuda
    order = StreamOrder(torch.device("cuda", 0))
    with order:
        with order:
            pass
    current["name"] = "s2"
    with order:
        pass
    assert log == [("record", "s1"), ("wait", "s2", "s1")]


def test_calls_from_threads_do_not_overlap():
    order = StreamOrder(torch.device("cpu"))
    inside, overlaps = [0], [0]

    def call():
        for _ in range(50):
            with order:
                inside[0] += 1
                if inside[0] > 1:
                    overlaps[0] += 1
                time.sleep(0.0002)
                inside[0] -= 1

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps[0] == 0


def test_one_order_per_device():
    assert order_for("cpu") is order_for(torch.device("cpu"))
    assert isinstance(order_for("cpu"), stream_order.StreamOrder)


def test_a_stream_object_is_made_only_when_the_stream_changes(fake_cuda, monkeypatch):
    log, current = fake_cuda
    made = []
    fake_current = torch.cuda.current_stream
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: made.append(1) or fake_current(device))
    order = StreamOrder(torch.device("cuda", 0))
    for name in ("s1",) * 5:
        current["name"] = name
        order.exit(order.enter())
    assert len(made) == 1  # the first call's stream, kept for a later switch
    for name in ("s2", "s1", "s2", "s1"):
        current["name"] = name
        with order:
            pass
    assert log.count(("record", "s1")) == 2 and ("wait", "s2", "s1") in log
    assert len(made) == 2  # one stream object per stream, whatever the switches


def test_a_nested_with_keeps_the_outer_stream_for_its_exit(fake_cuda):
    log, current = fake_cuda
    order = StreamOrder(torch.device("cuda", 0))
    with order:
        current["name"] = "s2"
        with order:  # nested, on another stream: no wait, and the outer call's stream stays
            pass
        current["name"] = "s1"
    current["name"] = "s2"
    with order:
        pass
    assert log == [("record", "s1"), ("wait", "s2", "s1")]
