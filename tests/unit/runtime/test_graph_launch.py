"""``graph_launch.py`` without a GPU: when a graph stays on PyTorch's replay, and why.

The driver path itself (instantiation for device launch, launches on any stream and thread) runs in
``tests/gpu/test_graph_launch_gpu.py``. Here fakes stand in for the graph and the driver, so the
decision and its fallbacks are checked on every machine.
"""

from __future__ import annotations

import logging

import pytest
import torch

from vit_graph_backend.runtime import launch as graph_launch
from vit_graph_backend.runtime.launch import launch_kind, make_launcher


class _FakeGraph:
    """Stands in for a ``torch.cuda.CUDAGraph`` captured with ``keep_graph=True``."""

    def __init__(self):
        self.instantiated = 0

    def instantiate(self):
        self.instantiated += 1

    def raw_cuda_graph(self):  # pragma: no cover - a refused path never reads it
        raise AssertionError("the driver path must not run here")


@pytest.fixture(autouse=True)
def _fresh_log_memory(monkeypatch):
    monkeypatch.setattr(graph_launch, "_logged", set())


@pytest.mark.parametrize("mode, uses_rng, reason", [
    ("torch", False, "graph_launch='torch'"),
    ("auto", True, "the forward draws random numbers"),
    ("auto", None, "no warm-up ran (warmup_iters=0)"),
])
def test_refused_device_launch_instantiates_through_torch_and_logs_why(
        mode, uses_rng, reason, caplog):
    graph = _FakeGraph()
    with caplog.at_level(logging.INFO, logger="vit_graph_backend.runtime.launch"):
        launcher = make_launcher(graph, torch.device("cuda", 0), mode, uses_rng)
        make_launcher(_FakeGraph(), torch.device("cuda", 0), mode, uses_rng)
    assert launcher is graph and graph.instantiated == 1
    assert launch_kind(launcher) == "torch"
    messages = [r.getMessage() for r in caplog.records if reason in r.getMessage()]
    assert len(messages) == 1, caplog.text  # once per reason, not once per graph


def test_driver_library_missing_keeps_torch_replay(monkeypatch, caplog):
    monkeypatch.setattr(graph_launch, "_driver", lambda: OSError("libcuda.so.1: not found"))
    graph = _FakeGraph()
    with caplog.at_level(logging.INFO, logger="vit_graph_backend.runtime.launch"):
        assert make_launcher(graph, torch.device("cuda", 0), "auto", False) is graph
    assert graph.instantiated == 1
    assert "the CUDA driver library did not load (libcuda.so.1: not found)" in caplog.text


def test_launch_kind_of_a_device_launch_graph():
    assert graph_launch.DeviceLaunchGraph.kind == "device"
    assert launch_kind(object()) == "torch"


def test_torch_still_offers_what_graph_launch_and_capture_use():
    """Public PyTorch APIs the capture relies on (``graph_capture.py``, ``graph_launch.py``):
    a release that renames them should fail here, not inside a user's first capture."""
    import inspect

    assert "keep_graph" in inspect.signature(torch.cuda.CUDAGraph.__new__).parameters
    for name in ("raw_cuda_graph", "instantiate", "replay", "pool"):
        assert callable(getattr(torch.cuda.CUDAGraph, name, None)), name
    assert "stream" in inspect.signature(torch.cuda.graph).parameters
    assert hasattr(torch.cuda, "default_generators")
    assert callable(getattr(torch.Generator, "get_offset", None))


class _FakeStream:
    def __init__(self, device):
        self.device_index = device


def test_one_capture_stream_per_device_made_once(monkeypatch):
    """Not ``torch.cuda.graph``'s one default stream for the process: each device its own,
    reused by every later capture on it (the pool's blocks go to the stream that freed them)."""
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(graph_launch, "_capture_streams", {})
    first = graph_launch.capture_stream(torch.device("cuda", 0))
    second = graph_launch.capture_stream(torch.device("cuda", 1))
    assert (first.device_index, second.device_index) == (0, 1)
    assert graph_launch.capture_stream(torch.device("cuda", 0)) is first
    assert graph_launch.capture_stream(torch.device("cuda", 1)) is second


def test_a_budget_is_captured_on_its_device_s_stream(monkeypatch):
    """``capture_budget_graph`` names the capture stream of the encoder's device, whichever
    device is current (on a GPU: ``tests/gpu/test_graph_runtime_gpu.py``'s second-GPU test)."""
    import contextlib

    from vit_graph_backend.runtime import capture as graph_capture

    used = []

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        used.append(stream)
        yield

    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(graph_launch, "_capture_streams", {})
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda keep_graph=False: _FakeGraph())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(graph_capture, "make_launcher", lambda g, *args: g)
    outcome = graph_capture.capture_budget_graph(
        8, lambda static: static["x"] + 1, {"x": torch.zeros(2)}, pool=(0, 1),
        device=torch.device("cuda", 1), warmup_iters=0, memory=graph_capture.GraphMemory(),
        held=0, new_static=0)
    assert outcome.skipped is None, outcome.skipped
    assert len(used) == 1 and used[0] is graph_launch.capture_stream(torch.device("cuda", 1))
    assert used[0].device_index == 1
