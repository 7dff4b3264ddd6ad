"""The ``vitgraph bench`` harness: workloads, defaults, routing preview and timing. CPU only.
The result schema, the models and the modes: ``test_bench_runs.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import vit_graph_backend
from vit_graph_backend.bench import (
    MODELS,
    WORKLOADS,
    BenchConfig,
    resolve,
)
from vit_graph_backend.bench.models import call_specs
from vit_graph_backend.bench.runner import stream_budget_range
from vit_graph_backend.options import VitGraphOptions
from vit_graph_backend.plan_preview import plan_stream, summarize_plans
from vit_graph_backend.bench.timing import CallTimer, percentile, summarize
from vit_graph_backend.bench.workloads import make_stream, resolve_modality
from vit_graph_backend.budgets import BudgetConfig
from vit_graph_backend.specs import EncoderItemSpec

SRC = Path(vit_graph_backend.__file__).resolve().parent
TINY = [name for name in MODELS if name.endswith("-tiny") or name == "vit-micro"]

# -- workloads -----------------------------------------------------------------------------------


@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("model", ["vit-micro", "qwen2.5-vl-tiny"])
def test_streams_are_seeded_and_within_the_size_space(workload, model):
    entry = MODELS[model]
    try:
        modality = resolve_modality(workload, None, packed=entry.packed)
    except ValueError:
        assert workload == "video" and not entry.packed
        return
    kwargs = dict(calls=20, seed=3, max_batch=5)
    stream = make_stream(workload, modality, entry.space, **kwargs)
    assert stream == make_stream(workload, modality, entry.space, **kwargs)
    one_shape = workload == "fixed-batch" or (workload == "gpu-bound" and not entry.packed)
    assert stream != make_stream(workload, modality, entry.space, **{**kwargs, "seed": 4}) or (
        one_shape)  # gpu-bound with max_batch 5 < 8: every call has 5 images of the base size
    for call in stream:
        assert 1 <= len(call.items) <= 5
        for item in call.items:
            assert item.height in entry.space.sizes and item.width in entry.space.sizes
            assert item.is_video == (modality == "video")
        if not entry.packed:  # one [B, C, H, W] tensor per call
            assert len({(i.height, i.width) for i in call.items}) == 1


def test_mixed_batch_calls_have_max_batch_images_of_several_sizes():
    space = MODELS["qwen2-vl-tiny"].space
    stream = make_stream("mixed-batch", "image", space, calls=6, seed=0, max_batch=16)
    assert [len(call.items) for call in stream] == [16] * 6
    assert all(len({(i.height, i.width) for i in call.items}) > 1 for call in stream)
    batched = MODELS["vit-micro"].space
    for call in make_stream("mixed-batch", "image", batched, calls=6, seed=0, max_batch=8):
        assert len(call.items) == 8 and len({(i.height, i.width) for i in call.items}) == 1


def test_image_plus_video_adds_one_video_per_call():
    space = MODELS["qwen2-vl-tiny"].space
    for call in make_stream("multi-image", "image+video", space, calls=10, seed=0, max_batch=4):
        assert [i.is_video for i in call.items].count(True) == 1
        assert call.items[-1].frames in space.video_frames


@pytest.mark.parametrize(("workload", "modality", "packed", "needle"), [
    ("video", "image", True, "streams videos"),
    ("uniform-batch", "video", False, "needs a packed"),
    ("uniform-batch", "sound", True, "modality='sound' is invalid"),
])
def test_modality_clashes_are_named(workload, modality, packed, needle):
    with pytest.raises(ValueError, match=needle):
        resolve_modality(workload, modality, packed=packed)


# -- defaults and routing ------------------------------------------------------------------------


def _timm_runs() -> bool:
    try:
        import timm  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or its torchvision fails beside this torch
        return False
    return True


def test_defaults_depend_on_the_device():
    """The default models are timm's ViTs, or the same shapes from transformers without timm
    (the README's test command installs no timm)."""
    timm = _timm_runs()
    cpu = resolve(BenchConfig(), cuda_available=False).config
    assert (cpu.model, cpu.device, cpu.dtype, cpu.modes, cpu.calls, cpu.max_batch) == (
        "vit-micro" if timm else "clip-tiny", "cpu", "float32", ("eager", "vitgraph"), 24, 8)
    gpu = resolve(BenchConfig(), cuda_available=True).config
    assert (gpu.model, gpu.device, gpu.dtype, gpu.calls, gpu.max_batch) == (
        "vit-b16" if timm else "clip-b16", "cuda", "bfloat16", 120, 32)
    assert gpu.modes == ("eager", "compile-default", "reduce-overhead", "vitgraph",
                         "vitgraph-eager")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve(BenchConfig(device="cuda"), cuda_available=False)


@pytest.mark.parametrize(("modality", "items"), [("image", 1), ("video", 1), ("image+video", 2)])
def test_items_per_graph_default_follows_the_modality(modality, items):
    run = resolve(BenchConfig(model="qwen2-vl-tiny", workload="multi-image", modality=modality),
                  cuda_available=False)
    assert run.vitgraph_options["max_items_per_graph"] == items
    assert ("max_frames_per_batch" in run.vitgraph_options) == (modality != "image")


def test_batched_budgets_count_rows_and_cover_the_stream():
    run = resolve(BenchConfig(model="vit-micro", max_batch=6), cuda_available=False)
    # the runtime's batched default splits each doubling into 4 steps
    assert run.budgets.budgets == (1, 2, 3, 4, 5, 6)
    assert run.vitgraph_options == {"budgets": [1, 2, 3, 4, 5, 6], "policy": "baseline"}
    # the bench resolves as torch.compile's backend does: the same config for the same options
    assert run.budgets == VitGraphOptions(max_budget=6).resolve(batched=True)
    run = resolve(BenchConfig(model="vit-micro", max_batch=6, max_budget=32, ladder_steps=1),
                  cuda_available=False)
    assert run.budgets.budgets == (1, 2, 4, 8, 16, 32)
    run = resolve(BenchConfig(model="vit-micro", max_batch=6, ladder_steps=1),
                  cuda_available=False)
    assert run.budgets.budgets == (1, 2, 4, 6)
    with pytest.raises(ValueError, match=r"ladder_steps=0 is invalid"):
        resolve(BenchConfig(model="vit-micro", ladder_steps=0), cuda_available=False)


def test_gpu_bound_calls_are_large():
    vit, qwen = MODELS["vit-micro"], MODELS["qwen2.5-vl-tiny"]
    stream = make_stream("gpu-bound", "image", vit.space, calls=50, seed=0, max_batch=48)
    assert {len(c.items) for c in stream} <= set(range(8, 49)) and len(
        {len(c.items) for c in stream}) > 10
    assert all(i.height == vit.space.base for c in stream for i in c.items)
    stream = make_stream("gpu-bound", "image", qwen.space, calls=50, seed=0, max_batch=4)
    assert qwen.space.sizes == (56, 84, 112, 140, 168)  # its largest third: 140 and 168 px
    assert all(len(c.items) == 1 for c in stream)
    assert {i.height for c in stream for i in c.items} == {140, 168}


def test_packed_stream_range_fits_every_call():
    calls = [[64, 256], [100], [1024, 300, 16]]
    assert stream_budget_range(calls, 1) == (16, 1024)  # power of two under the smallest item
    assert stream_budget_range(calls, 2) == (16, 1024 + 300)  # two largest items of a call
    assert stream_budget_range(calls, 32) == (32, 1024 + 300 + 16)  # a token per item slot
    assert stream_budget_range([[3]], 4) == (3, 3)  # start never above stop
    with pytest.raises(ValueError, match="no items"):
        stream_budget_range([[]], 1)


def test_packed_bench_budgets_are_the_options_resolution_over_the_stream_range():
    run = resolve(BenchConfig(model="qwen2-vl-tiny", workload="multi-image", ladder_steps=1),
                  cuda_available=False)
    calls = [[s.output_tokens for s in call_specs(run.entry, c)] for c in run.stream]
    expected = VitGraphOptions(max_items_per_graph=1, ladder_steps=1).resolve(
        stream_budget_range(calls, 1))
    assert run.budgets == expected
    assert run.budgets.budgets[0] & (run.budgets.budgets[0] - 1) == 0  # doubling from 2**k


def test_planned_totals_are_counted_like_the_backend():
    config = BudgetConfig((4, 8), max_batch_size=2)
    calls = [[EncoderItemSpec(3, 3), EncoderItemSpec(3, 3)], [EncoderItemSpec(20, 20)]]
    stats = summarize_plans(plan_stream(calls, config), config)
    # call 0: 3 + 3 = 6 tokens -> budget 8 (2 padding); call 1: 20 > 8 -> eager.
    assert (stats["calls"], stats["graph_replays"], stats["eager_batches"]) == (2, 1, 1)
    assert (stats["real_tokens"], stats["padded_tokens"]) == (6, 2)
    assert stats["batches_per_budget"] == {"8": 1} and stats["hit_rate"] == 2 / 3


def test_call_specs():
    [call] = make_stream("fixed-batch", "image", MODELS["vit-micro"].space, calls=1, seed=0,
                         max_batch=5)
    assert call_specs(MODELS["vit-micro"], call) == [EncoderItemSpec(5, 5)]  # one row item
    from vit_graph_backend.bench.workloads import Call, Item

    qwen = MODELS["qwen2.5-vl-tiny"]  # patch 14, merge 2, temporal patch 2
    specs = call_specs(qwen, Call((Item(56, 84), Item(56, 56, frames=4))))
    assert specs == [EncoderItemSpec(4 * 6, 2 * 3), EncoderItemSpec(2 * 16, 2 * 4, 2)]


# -- timing --------------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 99) == pytest.approx(4.96)  # numpy.percentile(values, 99)
    assert percentile([7.0], 99) == 7.0
    assert summarize([1.0, 3.0]) == {"p50": 2.0, "p99": pytest.approx(2.98), "mean": 2.0,
                                     "min": 1.0, "max": 3.0}
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_host_time_ends_when_the_call_returns_and_the_device_is_waited_on_after(monkeypatch):
    """``CallTimer.host``: synced before the call, the clock stopped at its return, synced after
    (a CUDA device stood in for: the two syncs are recorded, the call sleeps 20 ms)."""
    import time

    timer = CallTimer("cpu")
    events = []
    monkeypatch.setattr(timer, "sync", lambda: events.append("sync"))
    result, seconds = timer.host(lambda: events.append("call") or time.sleep(0.02) or 7)
    assert result == 7 and events == ["sync", "call", "sync"]
    assert 0.02 <= seconds < 1.0
