"""Threads, streams and memory pressure on a GPU. Every test here needs CUDA (marked ``gpu``):

- 4 threads, 2 on streams of their own, on the batched and the packed path, with NaN poisoned
  into static buffers and the pool between calls: every output equal to eager;
- a capture that fails (host sync) for the large budgets leaves the smaller ones captured, the
  thread's current stream unchanged;
- ``max_graph_memory`` skips the budgets over the bound, largest first, with their reasons;
- a filler tensor taking most of the memory: the budgets that fit are captured and serve;
- ``clear()`` and capture again into the same pool handle.
"""

from __future__ import annotations

import pytest
import torch

from toy_encoders import PaddedSegToyEncoder, run_alone
from stress.suite import StressConfig, run_stress
from vit_graph_backend.options import VitGraphOptions
from vit_graph_backend.runtime.manager import EncoderCudaGraphManager

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _toy(mbs=4, dim=32, budget_range=(8, 64)):
    torch.manual_seed(0)
    return PaddedSegToyEncoder(dim=dim, budget_range=budget_range, max_batch_size=mbs).to(DEV).eval()


def _inputs(lengths, dim=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(sum(lengths), dim, generator=g).to(DEV), "lengths": list(lengths)}


def _check(mgr, model, lengths, seed=1):
    inputs = _inputs(lengths, dim=model.dim, seed=seed)
    for got, ref in zip(mgr.run(inputs), run_alone(model, inputs), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_threads_on_their_own_streams_get_eager_outputs():
    pytest.importorskip("timm")
    pytest.importorskip("transformers")
    rows = run_stress(StressConfig(calls=600, parts=("batched", "packed")))
    for r in rows:
        print("stress", r)
        assert r["calls"] == 600
        assert (r["wrong"], r["nan"], r["exceptions"]) == (0, 0, 0), r
        assert r["replays"] > 0


@torch.no_grad()
def test_failed_capture_of_large_budgets_keeps_the_small_ones():
    model = _toy()
    model.sync_above_rows = 40          # budgets 48 and 64 host-sync: their capture fails
    mgr = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=4))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with pytest.warns(RuntimeWarning, match="capture failed"):
            mgr.capture()
        assert torch.cuda.current_stream() == stream   # not left on the capture stream
    report = mgr.memory_report()
    print("after failed large captures", report)
    assert set(report["skipped_budgets"]) == {48, 64}
    assert report["captured_budgets"] == [8, 12, 16, 24, 32]
    model.sync_above_rows = None
    _check(mgr, model, [5, 9, 3])        # 17 tokens: budget 24, a graph
    _check(mgr, model, [60])             # only fit in a skipped budget: eager
    assert mgr.stats.graph_replays >= 1 and mgr.stats.eager_batches >= 1
    assert any("budget 64 is not served" in r for r in mgr.stats.as_dict()["fallback_reasons"])


@torch.no_grad()
def test_max_graph_memory_skips_the_largest_budgets():
    # a wide toy so that the budgets' memory differs by megabytes
    model = _toy(dim=1024, budget_range=(256, 8192))
    free_run = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=4))
    free_run.capture()
    full = free_run.memory_report()
    free_run.clear()
    bound = full["estimated_bytes"][1024] + full["static_input_bytes"] // 4
    mgr = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=4,
                                                         max_graph_memory=bound))
    mgr.capture()
    report = mgr.memory_report()
    print("unbounded", full, "\nbounded", report)
    assert report["skipped_budgets"] and report["captured_budgets"]
    assert 8192 in report["skipped_budgets"]          # largest first: the big ones go
    assert all("max_graph_memory" in why for why in report["skipped_budgets"].values())
    # a graph captured over the bound is dropped, but the pool keeps the memory it touched:
    # the bound holds up to one budget's estimate (graph_capture.py)
    assert report["total_bytes"] <= bound + max(report["estimated_bytes"].values())
    _check(mgr, model, [300, 200])
    _check(mgr, model, [5000])                        # a skipped budget's call: eager


@torch.no_grad()
def test_memory_pressure_captures_what_fits():
    model = _toy(dim=2048, budget_range=(512, 65536))
    probe = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=4))
    probe.capture()
    est = probe.memory_report()["estimated_bytes"]
    probe.clear()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    keep = est[8192] * 4 + (256 << 20)     # room for about the 8192 budget and smaller
    filler = torch.empty(free - keep, dtype=torch.uint8, device=DEV)
    try:
        mgr = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=4))
        mgr.capture()
        report = mgr.memory_report()
        print("estimates", est, "\nunder pressure", report)
        assert report["captured_budgets"], report
        assert 65536 in report["skipped_budgets"]
    finally:
        del filler
        torch.cuda.empty_cache()
    # the captured graphs serve; a skipped budget's call replays a larger graph or runs eagerly
    _check(mgr, model, [100, 200, 50])
    _check(mgr, model, [9000])
    assert mgr.stats.graph_replays >= 1


@torch.no_grad()
def test_smaller_graphs_reuse_the_largest_ones_pool_memory():
    model = _toy(dim=1024, budget_range=(256, 8192))
    alone = EncoderCudaGraphManager(model, VitGraphOptions(budgets=[8192], max_items_per_graph=4))
    alone.capture()
    largest = alone.memory_report()["pool_bytes"]
    alone.clear()
    ladder = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=4))
    ladder.capture()
    report = ladder.memory_report()
    print("pool of the largest graph alone", largest, "of the whole ladder", report["pool_bytes"],
          report["captured_budgets"])
    assert len(report["captured_budgets"]) == 11
    # shared: the ladder's 10 smaller graphs add little beyond the largest one's pool
    assert report["pool_bytes"] <= 1.5 * largest


@torch.no_grad()
def test_clear_and_capture_again_into_the_same_pool():
    model = _toy()
    mgr = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=4))
    pool = torch.cuda.graph_pool_handle()
    for round_ in range(3):
        mgr.capture(pool)
        assert mgr.num_graphs == 7 and mgr.graph_pool == pool
        _check(mgr, model, [7, 20, 3], seed=round_)
        mgr.clear()
        assert mgr.num_graphs == 0
