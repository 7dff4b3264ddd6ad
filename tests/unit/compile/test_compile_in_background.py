"""``compile_in_background`` on CPU: calls answered by the model's own forward until the thread
has compiled, then by the compiled model; a bad first request raises as eager does and starts
nothing; a failed compile leaves calls eager with the reason; what ``report()`` and
``wait_prepared()`` say. Graphs on CUDA: ``tests/gpu/test_background_gpu.py``."""

from __future__ import annotations

import copy
import logging
import threading
import time

import pytest
import torch

import vit_graph_backend
from test_backend import ATOL, _hf, _tensors
from vit_graph_backend.compile.background import COMPILING, compile_in_background
from vit_graph_backend.errors import InvalidOptionError


def _close(got, want) -> None:
    for g, w in zip(_tensors(got), _tensors(want), strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


@pytest.fixture
def clip():
    torch.manual_seed(0)
    torch.compiler.reset()
    yield _hf("clip").eval()
    torch.compiler.reset()


@torch.no_grad()
def test_calls_are_eager_until_compiled_then_compiled_at_every_batch_size(clip, padded_cpu):
    served = compile_in_background(clip, {"max_budget": 8})
    x = {b: torch.randn(b, 3, 32, 32) for b in (3, 1, 5, 12)}
    _close(served(x[3]), clip(x[3]))
    assert served.wait_compiled(timeout=300), served.failure
    eager = vit_graph_backend.report()["stats"]["fallback_reasons"][COMPILING]
    for b, t in x.items():
        _close(served(t), clip(t))
    report = vit_graph_backend.report()
    assert report["stats"]["fallback_reasons"][COMPILING] == eager >= 1   # none after
    assert report["compiles"] == 2   # the dynamic batch axis, then a batch of one
    assert report["preparing"] == 0 and served.compile_seconds > 0
    assert list(served.state_dict()) == [f"model.{k}" for k in clip.state_dict()]
    assert served.config is clip.config   # the model's own attributes
    with pytest.raises(TypeError, match="cannot be pickled or copied .* its .model"):
        copy.deepcopy(served)


@torch.no_grad()
def test_a_bad_first_request_raises_as_eager_and_starts_nothing(clip, padded_cpu):
    served = compile_in_background(clip)
    with pytest.raises(RuntimeError) as raised:
        served(torch.randn(2, 4, 32, 32))   # 4 channels for 3
    with pytest.raises(RuntimeError) as eager:
        clip(torch.randn(2, 4, 32, 32))
    assert str(raised.value) == str(eager.value)
    assert served._thread is None and vit_graph_backend.report()["compiles"] == 0
    x = torch.randn(2, 3, 32, 32)
    _close(served(x), clip(x))
    assert served.wait_compiled(timeout=300)


@torch.no_grad()
def test_a_failed_compile_leaves_calls_eager_with_the_reason(clip, caplog):
    served = compile_in_background(clip)

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    served.__dict__["compiled"] = broken
    x = torch.randn(2, 3, 32, 32)
    with caplog.at_level(logging.WARNING, logger="vit_graph_backend"):
        served(x)
        assert not served.wait_compiled(timeout=60)
    reason = "compiling in the background failed: RuntimeError: no compiler here"
    assert served.failure == reason and reason in caplog.text
    _close(served(x), clip(x))
    assert vit_graph_backend.report()["stats"]["fallback_reasons"][reason] == 1


@torch.no_grad()
def test_the_thread_traces_a_dynamic_batch_then_a_batch_of_one_answered_eagerly_until_then(clip):
    """A first batch of one is traced repeated to two rows; until the batch of one is traced,
    batches of one are answered eagerly and larger ones run compiled."""
    served = compile_in_background(clip)
    seen, release = [], threading.Event()

    def compiled(x):
        seen.append(x.clone())
        if len(seen) == 2 and threading.current_thread() is served._thread:
            release.wait(60)   # the trace of a batch of one, held
        return clip(x)

    served.__dict__["compiled"] = compiled
    one = torch.randn(1, 3, 32, 32)
    served(one)
    deadline = time.monotonic() + 60
    while len(seen) < 2 and time.monotonic() < deadline:
        served._thread.join(0.01)
    assert seen[0].shape[0] == 2 and torch.equal(seen[0], one.repeat(2, 1, 1, 1))
    assert seen[1].shape[0] == 1 and served.preparing
    assert vit_graph_backend.report()["preparing"] >= 1
    assert not vit_graph_backend.wait_prepared(timeout=0.05)
    served(one)                         # eager: no compiled call
    served(torch.randn(4, 3, 32, 32))   # compiled
    assert [t.shape[0] for t in seen] == [2, 1, 4]
    release.set()
    assert vit_graph_backend.wait_prepared(timeout=60) and served.wait_compiled(0)
    served(one)
    assert [t.shape[0] for t in seen] == [2, 1, 4, 1]


@torch.no_grad()
def test_threads_calling_through_the_switch_get_eager_numbers(clip, padded_cpu):
    """Three threads call while the compile is held, then through the switch: every output
    within tolerance of eager, some answered eagerly and some compiled."""
    served = compile_in_background(clip, {"max_budget": 8})
    real, release, compiled_calls = served.compiled, threading.Event(), []

    def held(*args, **kwargs):
        if threading.current_thread() is served._thread:
            release.wait(60)
        else:
            compiled_calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    served.__dict__["compiled"] = held
    x = [torch.randn(b, 3, 32, 32) for b in (2, 3, 5, 7)]
    refs = [clip(t) for t in x]
    errors, answered, lock = [], [0], threading.Lock()

    def calls(k: int) -> None:
        deadline = time.monotonic() + 120
        with torch.no_grad():
            i = 0   # 40 calls, then on until some ran compiled
            while (i < 40 or not compiled_calls) and time.monotonic() < deadline:
                i += 1
                j = (i + k) % len(x)
                try:
                    _close(served(x[j]), refs[j])
                except Exception as exc:   # noqa: BLE001 - every failure is the test's
                    errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                with lock:
                    answered[0] += 1
                    if answered[0] >= 30:
                        release.set()   # the compile goes on mid-stream
                time.sleep(0.01)

    threads = [threading.Thread(target=calls, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[:3]
    assert served.wait_compiled(timeout=300), (served.failure, served.failure_one)
    reasons = vit_graph_backend.report()["stats"]["fallback_reasons"]
    assert set(reasons) == {COMPILING} and reasons[COMPILING] >= 30
    assert compiled_calls, "no call reached the compiled model after the switch"


def test_options_are_checked_when_wrapped():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(InvalidOptionError, match="batch_invariant=True is invalid with "
                                                 "compile_in_background"):
        compile_in_background(model, {"batch_invariant": True})
    with pytest.raises(InvalidOptionError, match="max_budgte"):
        compile_in_background(model, {"max_budgte": 8})


@torch.no_grad()
def test_a_batch_of_nothing_starts_no_compile(padded_cpu):
    torch.compiler.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()
    served = compile_in_background(model)
    empty = torch.randn(0, 8)
    assert served(empty).shape == (0, 8)
    assert served._thread is None
    x = torch.randn(3, 8)
    torch.testing.assert_close(served(x), model(x))
    assert served.wait_compiled(timeout=300), served.failure
    assert served(torch.randn(5, 8)).shape == (5, 8)
    torch.compiler.reset()


def test_the_exit_waits_for_a_capture_in_progress(tmp_path):
    """A thread stopped inside a stream capture can crash the interpreter's exit: the exit waits
    for the capture (held here by the capture gate) and lets the thread's later work be cut."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent("""
        import time, torch
        from vit_graph_backend.compile.background import compile_in_background
        from vit_graph_backend.runtime.capture import capturing

        served = compile_in_background(torch.nn.Linear(4, 4))

        def compiled(x):
            with capturing():
                time.sleep(1.0)
                print("capture ended", flush=True)
            time.sleep(60)

        served.__dict__["compiled"] = compiled
        served(torch.randn(2, 4))
        time.sleep(0.2)
        print("exiting", flush=True)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["exiting", "capture", "ended"]


def test_the_thread_compiles_under_the_callers_autocast(clip):
    """Dynamo guards on autocast: a compile outside the caller's autocast would not serve it."""
    served = compile_in_background(clip)
    modes = []

    def compiled(x):
        modes.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return clip(x)

    served.__dict__["compiled"] = compiled
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        served(torch.randn(2, 3, 32, 32))
    assert served.wait_compiled(timeout=60)
    assert modes == [(True, torch.bfloat16)] * 2   # the dynamic batch, then a batch of one
