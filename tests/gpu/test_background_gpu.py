"""``capture="background"`` on CUDA: the first calls are answered by the model's own forward
while a thread captures real graphs beside them, then calls replay those graphs; for a served
Qwen-VL tower and for ``torch.compile(vit, backend="vitgraph")``. The stress suite's ``switch``
part runs the same switch under four threads on two streams with poisoned memory."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from packed_towers import PATCH, _call, _hf, _tower
from vit_graph_backend import serve
from vit_graph_backend.runtime.manager import PREPARING

pytestmark = pytest.mark.gpu


def _error(got, ref) -> float:
    got = got if isinstance(got, tuple) else (got,)
    worst = 0.0
    for g, r in zip(got, ref, strict=True):
        assert g.shape == r.shape and torch.isfinite(g).all()
        scale = max(r.float().abs().max().item(), 1.0)
        worst = max(worst, (g.float() - r.float()).abs().max().item() / scale)
    return worst


def _served(seed: int, count: int):
    """A Qwen2.5-VL tower served with ``capture="background"``, ``count`` calls and HF's outputs."""
    tower = _tower("qwen2_5")
    served = serve(tower, max_items_per_graph=4, max_budget=1024, capture="background")
    rng = random.Random(seed)
    calls = [_call(rng, 1 + k % 4, PATCH) for k in range(count)]
    return served, calls, [_hf(tower, pv, grid) for pv, grid in calls]


@torch.no_grad()
def test_served_tower_answers_first_calls_eagerly_then_replays_prepared_graphs():
    served, calls, refs = _served(0, 8)
    first = served(*calls[0])
    report = served.report()
    # answered by the tower's own forward: HF's numbers exactly
    assert _error(first, refs[0]) == 0.0
    assert report["preparing"] == 1 and report["stats"]["fallback_reasons"] == {PREPARING: 1}
    assert served.wait_prepared(timeout=300)
    mgr = served.manager
    assert mgr.num_graphs == len(mgr.token_budgets) == mgr.get_num_graphs_to_capture()
    worst = max(_error(served(*c), r) for c, r in zip(calls, refs))
    report = served.report()
    print(f"background: prepared in {report['prepare_seconds']:.2f} s; max relative error vs "
          f"HF after the switch {worst:.3g}; stats {report['stats']}")
    assert worst < 5e-2
    assert report["preparing"] == 0 and report["prepare_seconds"] > 0
    assert report["stats"]["graph_replays"] > 0
    assert report["stats"]["fallback_reasons"] == {PREPARING: 1}   # nothing else ran eagerly
    served.manager.clear()            # graphs dropped: the next call prepares them again
    assert _error(served(*calls[1]), refs[1]) == 0.0
    assert served.report()["preparing"] == 1
    served.manager.clear()            # cancelled while preparing: waits for its capture
    report = served.report()
    assert report["preparing"] == 0 and report["graphs_captured"] == 0
    served(*calls[2])                 # and the next call prepares again
    assert served.wait_prepared(timeout=300) and served.report()["graphs_captured"] > 0


@torch.no_grad()
def test_threads_on_two_streams_call_through_the_switch():
    served, calls, refs = _served(1, 12)
    errors: list[str] = []
    worst = [0.0]
    done = threading.Event()

    def worker(w: int) -> None:
        stream = torch.cuda.Stream() if w % 2 else torch.cuda.current_stream()
        with torch.cuda.stream(stream), torch.no_grad():
            k = after = 0
            while not done.is_set() or k < 20 or after < 5:   # calls after the switch too
                after += done.is_set()
                i = (w * 5 + k) % len(calls)
                try:
                    err = _error(served(*calls[i]), refs[i])
                    worst[0] = max(worst[0], err)
                    if err > 5e-2:
                        errors.append(f"call {i}: error {err:.3g}")
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(f"{type(exc).__name__}: {exc}")
                k += 1
            stream.synchronize()

    served(*calls[0])                       # the preparation runs before the threads start
    assert served.report()["preparing"] == 1
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    assert served.wait_prepared(timeout=300)
    done.set()
    for t in threads:
        t.join(120)
    stats = served.report()["stats"]
    print(f"threads: worst error {worst[0]:.3g}; stats {stats}")
    assert not errors, errors[:5]
    assert stats["fallback_reasons"].get(PREPARING, 0) > 0 and stats["graph_replays"] > 0


@torch.no_grad()
def test_compiled_vit_answers_with_its_traced_graph_while_graphs_are_prepared():
    import vit_graph_backend
    from vit_graph_backend.bench.models import MODELS, build_model
    from vit_graph_backend.compile.backend import vitgraph

    torch.compiler.reset()
    built = build_model(MODELS["vit-s16"], device="cuda", dtype=torch.bfloat16,
                        dynamic_size=False)
    model = built.module
    compiled = torch.compile(model, backend=vitgraph,
                             options={"capture": "background", "inner_compiler": "eager"})
    x = [torch.randn(b, 3, 224, 224, device="cuda", dtype=torch.bfloat16) for b in (3, 8, 5)]
    refs = [model(t) for t in x]
    try:
        outs = [compiled(t) for t in x]
        assert vit_graph_backend.wait_prepared(timeout=300)
        report = vit_graph_backend.report()
        assert report["stats"]["fallback_reasons"].get(PREPARING, 0) >= 1
        outs += [compiled(t) for t in x]
        report = vit_graph_backend.report()
        assert report["stats"]["graph_replays"] >= 3 and report["preparing"] == 0
        for out, ref in zip(outs, refs + refs):
            assert _error(out, (ref,)) < 5e-2
    finally:
        torch.compiler.reset()


@torch.no_grad()
def test_calls_beside_the_preparation_may_synchronize_and_draw_random_numbers():
    """A device-wide synchronize or random numbers on the device raise while another thread
    captures; the calls answered beside the preparation never overlap its captures
    (``capture._Gate``), so neither the calls nor the captures fail."""
    served, calls, refs = _served(2, 6)
    tower = served.encoder
    reference = tower.encoder_reference_forward

    def noisy(inputs):
        torch.cuda.synchronize()
        torch.randn(16, device="cuda")
        return reference(inputs)

    tower.encoder_reference_forward = noisy
    try:
        answered = 0
        while True:
            for c, r in zip(calls, refs):
                assert _error(served(*c), r) < 5e-2
            answered += len(calls)
            if not served.report()["preparing"] or answered > 5000:
                break
    finally:
        del tower.encoder_reference_forward
    assert served.wait_prepared(timeout=300)
    report = served.report()
    print(f"calls beside the preparation: {report['stats']['fallback_reasons']}; "
          f"skipped {report['skipped_budgets']}")
    assert served.manager.num_graphs == len(served.manager.token_budgets)
    assert report["stats"]["fallback_reasons"].get(PREPARING, 0) > 1


@torch.no_grad()
def test_compile_in_background_answers_eagerly_then_runs_compiled_from_threads():
    """``compile_in_background``: the first call answered by the model's own forward at once,
    calls from two threads on two streams answered while a thread traces, compiles and
    captures, then every batch size (a batch of one too) from the graphs."""
    import vit_graph_backend
    from vit_graph_backend.bench.models import MODELS, build_model
    from vit_graph_backend.compile.background import COMPILING

    torch.compiler.reset()
    built = build_model(MODELS["vit-s16"], device="cuda", dtype=torch.bfloat16,
                        dynamic_size=False)
    model = built.module
    served = vit_graph_backend.compile_in_background(model, {"budgets": [4, 8]})
    x = {b: torch.randn(b, 3, 224, 224, device="cuda", dtype=torch.bfloat16) for b in (1, 3, 8, 5)}
    refs = {b: model(t) for b, t in x.items()}
    errors: list[str] = []

    def calls(stream: torch.cuda.Stream, seed: int) -> None:
        rng = random.Random(seed)
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(40):
                b = rng.choice(list(x))
                try:
                    out = served(x[b])
                    stream.synchronize()
                    if _error(out, (refs[b],)) > 5e-2:
                        errors.append(f"batch {b}: {_error(out, (refs[b],))}")
                except Exception as exc:   # noqa: BLE001 - every failure is the test's
                    errors.append(f"batch {b}: {type(exc).__name__}: {exc}"[:300])
    try:
        first = served(x[3])
        assert _error(first, (refs[3],)) == 0.0   # the model's own forward: eager exactly
        threads = [threading.Thread(target=calls, args=(torch.cuda.Stream(), s)) for s in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads)
        assert vit_graph_backend.wait_prepared(timeout=300) and served.wait_compiled(0)
        assert served.failure is None and served.compile_seconds > 0
        before = vit_graph_backend.report()["stats"]
        for b, t in x.items():
            assert _error(served(t), (refs[b],)) < 5e-2
        after = vit_graph_backend.report()["stats"]
        print(f"compile_in_background: {served.compile_seconds:.2f} s; {after}")
        assert not errors, errors[:5]
        assert before["fallback_reasons"].get(COMPILING, 0) >= 1
        assert after["eager_batches"] == before["eager_batches"]   # none after the switch
        assert after["graph_replays"] >= before["graph_replays"] + len(x)
    finally:
        torch.compiler.reset()
