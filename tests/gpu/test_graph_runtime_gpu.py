"""CUDA graph runtime on a GPU. Every test here needs CUDA (marked ``gpu``):

- one graph per budget, captured largest first into the supplied pool; ``clear()`` frees them;
- replay equals eager (fp32 and bf16, measured error printed), counters, memory report;
- NaN-poisoned static buffers do not reach outputs;
- capture failure (a host sync in the forward) falls back to eager with a warning;
- ``torch.compile(backend="vitgraph")`` on a timm ViT with the eager and inductor inner compilers;
- the default (``"auto"``: Inductor on CUDA) on one batch size again and again: the static graph
  is compiled at its second call and captured again into a fresh pool;
- two threads calling one compiled model.
"""

from __future__ import annotations

import threading

import pytest
import torch

from toy_encoders import PaddedSegToyEncoder, fill_static_floats_with_nan
from vit_graph_backend.options import VitGraphOptions
from vit_graph_backend.runtime.manager import EncoderCudaGraphManager

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _toy(dtype=torch.float32, mbs=4):
    torch.manual_seed(0)
    return PaddedSegToyEncoder(dim=32, budget_range=(8, 64), max_batch_size=mbs).to(DEV, dtype).eval()


def _inputs(lengths, dtype=torch.float32, dim=32, seed=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(sum(lengths), dim, generator=g).to(DEV, dtype)
    return {"x": x, "lengths": list(lengths)}


def _reference(model, inputs):
    offs = [0]
    for n in inputs["lengths"]:
        offs.append(offs[-1] + n)
    return [model(inputs["x"][offs[i]:offs[i + 1]], [n]) for i, n in enumerate(inputs["lengths"])]


@torch.no_grad()
def test_one_graph_per_budget_in_supplied_pool_and_clear_frees_it():
    model = _toy()
    mgr = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=4))
    # default ladder over the toy's range (8, 64): 8, 12, 16, 24, 32, 48, 64
    assert mgr.get_num_graphs_to_capture() == len(mgr.token_budgets) == 7
    from vit_graph_backend import _compat

    pool = torch.cuda.graph_pool_handle()
    mgr.capture(pool)
    assert mgr.graph_pool is pool
    assert mgr.num_graphs == 7
    assert all(e.graph.pool() == pool for e in mgr.graphs.entries.values())
    report = mgr.memory_report()
    print("memory report", report)
    assert report["pool_bytes"] == _compat.graph_pool_bytes(pool) > 0
    assert report["largest_budget"] == 64
    assert report["total_bytes"] < 256 * 2**20  # a toy at <=64 rows cannot plausibly hold more
    mgr.clear()
    assert mgr.num_graphs == 0 and mgr.graph_pool is None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # The allocator keeps a private pool's segments while the caller still holds its handle
    # (seen on torch 2.11); they must at least not grow when the set is captured again.
    held = _compat.graph_pool_bytes(pool)
    print("pool bytes after clear while the handle is held:", held)
    out = mgr.run(_inputs([5, 9]))  # a later call captures again, into a new pool
    assert mgr.num_graphs == 7 and len(out) == 2 and mgr.graph_pool is not pool


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@torch.no_grad()
def test_replay_equals_eager_and_counts(dtype, tol):
    model = _toy(dtype)
    mgr = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=4))
    worst = 0.0
    for seed, lengths in enumerate([[3], [8, 1, 30], [64], [2, 2, 2, 2, 2, 2], [100, 4], [17, 40]]):
        inputs = _inputs(lengths, dtype, seed=seed)
        got = mgr.run(inputs)
        ref = _reference(model, inputs)
        for g, r in zip(got, ref):
            assert g.shape == r.shape
            worst = max(worst, (g.float() - r.float()).abs().max().item())
    print(f"{dtype}: max abs error graph vs eager {worst:.3g}")
    assert worst <= tol
    stats = mgr.stats.as_dict()
    assert stats["eager_items"] == 1  # the 100-row item exceeds the largest budget
    assert stats["graph_replays"] > 0 and 0 < stats["hit_rate"] < 1
    assert mgr.num_graphs == 7


@torch.no_grad()
def test_nan_poisoned_static_buffers_do_not_change_outputs():
    model = _toy()
    mgr = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=4))
    inputs = _inputs([5, 11, 3])
    clean = mgr.run(inputs)
    fill_static_floats_with_nan(mgr)
    poisoned = mgr.run(inputs)
    for a, b in zip(clean, poisoned):
        assert torch.isfinite(b).all()
        # index_add_ sums with atomics, so two clean runs may differ in the last bits too
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_capture_failure_falls_back_to_eager_with_warning():
    model = _toy()
    model.sync_in_forward = True
    mgr = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=4))
    inputs = _inputs([5, 9])
    with pytest.warns(RuntimeWarning, match="capture failed"):
        got = mgr.run(inputs)
    model.sync_in_forward = False
    for g, r in zip(got, _reference(model, inputs)):
        torch.testing.assert_close(g, r)
    assert mgr.stats.eager_items == 2 and mgr.num_graphs == 0
    # the failed capture left the device's random generator usable (capture.close_failed_capture)
    assert torch.randn(4, device=DEV).isfinite().all()


@torch.no_grad()
def test_verify_mode_disables_a_wrong_graph():
    from toy_encoders import ToyPackedEncoder  # pads seg with zeros: padding joins item 0

    torch.manual_seed(0)
    model = ToyPackedEncoder(dim=32).to(DEV).eval()
    mgr = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=4, verify=True))
    inputs = _inputs([5, 9])
    with pytest.warns(RuntimeWarning, match="verification failed"):
        got = mgr.run(inputs)
    for g, r in zip(got, _reference(model, inputs)):
        torch.testing.assert_close(g, r)


def _vit(depth=2):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64,
                             depth=depth, num_classes=10).to(DEV).eval()


@pytest.mark.parametrize("inner", ["eager", "inductor"])
@torch.no_grad()
def test_compiled_timm_vit_matches_eager(inner):
    from vit_graph_backend.compile.backend import vitgraph

    model = _vit()
    compiled = torch.compile(model, backend="vitgraph", options={"inner_compiler": inner})
    worst = 0.0
    for b in [3, 5, 1, 7, 40, 2, 16, 33]:
        x = torch.randn(b, 3, 64, 64, device=DEV)
        worst = max(worst, (compiled(x) - model(x)).abs().max().item())
    report = vitgraph.report()
    print(inner, "max abs error", worst, report)
    assert worst < 1e-3
    assert report["compiles"] <= 3
    assert report["graphs_captured"] >= 6  # the 1..32 ladder, plus exact static graphs
    assert report["stats"]["eager_items"] == 0


@torch.no_grad()
def test_default_compiles_a_repeated_static_graph_at_its_second_call():
    from vit_graph_backend.compile.backend import vitgraph

    model = _vit()
    compiled = torch.compile(model, backend="vitgraph")  # inner_compiler="auto": Inductor here
    x = torch.randn(6, 3, 64, 64, device=DEV)
    ref = model(x)
    outs = [compiled(x) for _ in range(4)]
    (encoder,) = vitgraph.encoders
    assert encoder.static_shape and not encoder.compile_pending
    assert not isinstance(encoder.fn, torch.fx.GraphModule)  # Inductor's, not the trace
    worst = max((o - ref).abs().max().item() for o in outs)
    report = vitgraph.report()
    print("deferred static compile: max abs error", worst, report["stats"])
    assert worst < 1e-3
    assert report["compiles"] == 1 and report["graphs_captured"] == 1
    # every call from a graph: the first from the traced graph's, the others from Inductor's
    assert report["stats"]["graph_replays"] == 4 and report["stats"]["eager_batches"] == 0


@torch.no_grad()
def test_two_threads_share_one_compiled_model():
    model = _vit()
    compiled = torch.compile(model, backend="vitgraph")
    xs = [torch.randn(b, 3, 64, 64, device=DEV) for b in (2, 3, 5, 9)]
    for x in xs:
        compiled(x)  # compile and capture first
    refs = [model(x) for x in xs]
    errors = []

    def worker(k):
        with torch.no_grad():
            for _ in range(20):
                for x, r in zip(xs[k:] + xs[:k], refs[k:] + refs[:k]):
                    if (compiled(x) - r).abs().max().item() > 1e-3:
                        errors.append(k)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@torch.no_grad()
def test_an_encoder_on_the_second_gpu_captures_there_after_a_capture_on_the_first():
    """``torch.cuda.graph``'s default capture stream is one per process, made on the device that
    was current at its first use. After a capture on ``cuda:0`` (here one of PyTorch's own), an
    encoder on ``cuda:1`` called while ``cuda:0`` is current must still capture on ``cuda:1``:
    on the first GPU's stream its graphs came out empty (replays returned the capture's
    outputs) or its capture failed and left ``cuda:0``'s generator unusable."""
    warm = torch.cuda.CUDAGraph()
    with torch.cuda.device(0), torch.cuda.graph(warm):  # PyTorch's default stream, on cuda:0
        torch.ones(4, device="cuda:0").mul_(2)
    dev = torch.device("cuda", 1)
    torch.manual_seed(0)
    model = PaddedSegToyEncoder(dim=32, budget_range=(8, 64), max_batch_size=4).to(dev).eval()
    mgr = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=4))
    with torch.cuda.device(0):
        for seed in (1, 2, 3):  # new values each call: a stale graph output shows
            inputs = {k: v.to(dev) if torch.is_tensor(v) else v
                      for k, v in _inputs([5, 11, 3], seed=seed).items()}
            got = mgr.run(inputs)
            for g, r in zip(got, _reference(model, inputs)):
                assert g.device == dev
                torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    assert mgr.num_graphs > 0 and mgr.stats.eager_items == 0, mgr.stats
    torch.randn(8, device="cuda:0")  # cuda:0's generator is not left in capture mode
    torch.cuda.synchronize(dev)
