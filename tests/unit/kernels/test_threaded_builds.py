"""``_threaded_builds.build_side_by_side``: every configuration built, each in its own thread, a
failure kept from the caller, and nothing built (no crash) when no thread can start."""

from __future__ import annotations

import threading

import pytest

from vit_graph_backend.kernels import _threaded_builds
from vit_graph_backend.kernels._threaded_builds import build_side_by_side


def test_every_configuration_is_built_once_each_in_a_thread_of_its_own():
    built: dict[int, str] = {}
    barrier = threading.Barrier(3, timeout=10)  # all three builds must be running at once

    def build(config: int) -> None:
        barrier.wait()
        built[config] = threading.current_thread().name

    build_side_by_side(build, [1, 2, 3])
    assert sorted(built) == [1, 2, 3]
    assert len(set(built.values())) == 3
    assert all(name.startswith("vitgraph-triton") for name in built.values())


def test_a_failing_build_is_swallowed_and_the_others_still_run():
    built: list[int] = []

    def build(config: int) -> None:
        if config == 2:
            raise RuntimeError("out of shared memory")  # what Triton raises for a too-big tile
        built.append(config)

    build_side_by_side(build, [1, 2, 3])  # raises nothing
    assert sorted(built) == [1, 3]


@pytest.mark.parametrize("configs", [[], [7]])
def test_fewer_than_two_configurations_build_nothing(configs):
    built: list[int] = []
    build_side_by_side(built.append, configs)
    assert built == []


def test_no_thread_to_start_builds_nothing_and_raises_nothing(monkeypatch):
    class NoThreads:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(_threaded_builds, "ThreadPoolExecutor", NoThreads)
    built: list[int] = []
    build_side_by_side(built.append, [1, 2])
    assert built == []


def test_an_error_that_is_not_a_thread_failure_reaches_the_caller(monkeypatch):
    class Broken:
        def __init__(self, *args, **kwargs):
            raise TypeError("a bug, not a thread limit")

    monkeypatch.setattr(_threaded_builds, "ThreadPoolExecutor", Broken)
    with pytest.raises(TypeError, match="a bug"):
        build_side_by_side(lambda config: None, [1, 2])
