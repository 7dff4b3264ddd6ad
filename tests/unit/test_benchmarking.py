"""The ``vitgraph bench`` harness: workloads, defaults, routing preview, timing, schema, models, modes.

CPU only. The registry's tiny models are built and run once each; ``compile-default`` is run on one
static shape (one Inductor compile, marked ``slow``); the packed vitgraph path runs on a tiny
Qwen2.5-VL tower once ``vit_graph_backend.packed`` exists.
"""

from __future__ import annotations

import ast
import copy
import sys
from pathlib import Path

import pytest

import vit_graph_backend
from vit_graph_backend.benchmarking import (
    MODELS,
    RESULT_SCHEMA,
    SCHEMA_VERSION,
    WORKLOADS,
    BenchConfig,
    resolve,
    run_benchmark,
    validate,
)
from vit_graph_backend.benchmarking.models import availability, build_model, call_specs
from vit_graph_backend.benchmarking.attention_note import attention_note
from vit_graph_backend.benchmarking.runner import stream_budget_range
from vit_graph_backend.options import VitGraphOptions
from vit_graph_backend.plan_preview import plan_stream, summarize_plans
from vit_graph_backend.benchmarking.timing import CallTimer, percentile, summarize
from vit_graph_backend.benchmarking.workloads import make_stream, resolve_modality
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


def test_defaults_depend_on_the_device():
    cpu = resolve(BenchConfig(), cuda_available=False).config
    assert (cpu.model, cpu.device, cpu.dtype, cpu.modes, cpu.calls, cpu.max_batch) == (
        "vit-micro", "cpu", "float32", ("eager", "vitgraph"), 24, 8)
    gpu = resolve(BenchConfig(), cuda_available=True).config
    assert (gpu.model, gpu.device, gpu.dtype, gpu.calls, gpu.max_batch) == (
        "vit-b16", "cuda", "bfloat16", 120, 32)
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
    from vit_graph_backend.benchmarking.workloads import Call, Item

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


# -- JSON schema ---------------------------------------------------------------------------------

#: Schema version 4, frozen here: changing the document's keys must bump SCHEMA_VERSION.
#: (v2 = v1 plus config.ladder_steps; v3: the option names max_items_per_graph and
#: max_frames_per_batch, and the stats of report()'s graph/no-graph counts; v4: the roofline,
#: each mode's achieved TFLOP/s, fraction of peak and per-rank busy seconds, data parallelism.)
V1_TOP = {"schema_version", "tool", "package_version", "created_utc", "environment", "config",
          "routing", "notes", "modes", "roofline"}
V1_MODE = {"mode", "status", "error", "traceback", "latency_ms", "per_call_ms", "stream_total_s",
           "first_pass_s", "peak_memory_bytes", "graphs_captured", "compiles", "hit_rate",
           "padding_ratio", "max_abs_error", "speedup_vs_eager", "backend_report", "notes",
           "rank_busy_s", "achieved_tflops", "fraction_of_peak"}
V1_CONFIG = {"model", "workload", "modality", "modes", "calls", "seed", "max_batch", "budgets",
             "max_budget", "ladder_steps", "max_items_per_graph", "max_frames_per_batch",
             "policy", "device", "dtype", "check_calls", "progress", "layout", "family",
             "params", "items", "data_parallel", "world_size"}
V1_ROUTING = {"unit", "budgets", "max_items_per_graph", "max_frames_per_batch", "policy",
              "planned", "sample_plans"}
V3_STATS = {"calls", "graph_replays", "graph_items", "no_graph_batches", "no_graph_items",
            "eager_batches", "eager_items", "exact_shape_batches", "real_tokens",
            "padded_tokens", "hit_rate", "padding_ratio", "batches_per_budget",
            "fallback_reasons"}


def test_schema_v4_is_pinned():
    assert SCHEMA_VERSION == 4
    assert set(RESULT_SCHEMA["routing"]["planned"]) == V3_STATS
    assert set(RESULT_SCHEMA) == V1_TOP
    assert set(RESULT_SCHEMA["modes"].spec) == V1_MODE
    assert set(RESULT_SCHEMA["config"]) == V1_CONFIG
    assert set(RESULT_SCHEMA["routing"]) == V1_ROUTING


@pytest.fixture(scope="module")
def eager_doc():
    return run_benchmark(BenchConfig(model="vit-micro", modes=("eager",), calls=3, max_batch=3,
                                     progress=False))


def test_a_result_matches_the_schema_and_json_round_trips(eager_doc):
    import json

    assert validate(eager_doc) == []
    assert json.loads(json.dumps(eager_doc, allow_nan=False)) == eager_doc
    assert eager_doc["config"]["budgets"] == eager_doc["routing"]["budgets"]


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda d: d.pop("routing"), "missing keys ['routing']"),
    (lambda d: d.update(extra=1), "unexpected keys ['extra']"),
    (lambda d: d["modes"][0].update(status="maybe"), "'maybe' is not one of"),
    (lambda d: d["modes"][0].update(per_call_ms="fast"), "expected a list"),
    (lambda d: d["config"].update(calls=True), "got bool"),
    (lambda d: d["environment"].update(cpu_count="2"), "expected <class 'int'>"),
])
def test_validate_names_what_is_wrong(eager_doc, mutate, needle):
    doc = copy.deepcopy(eager_doc)
    mutate(doc)
    assert any(needle in problem for problem in validate(doc)), validate(doc)


# -- models and modes ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_build_and_emit_one_row_per_planned_token(name):
    import torch

    entry = MODELS[name]
    if availability(entry) is not None:
        pytest.skip(availability(entry))
    workload = "multi-image"
    modality = "image+video" if entry.packed else "image"
    [call] = make_stream(workload, modality, entry.space, calls=1, seed=1, max_batch=3)
    built = build_model(entry, device="cpu", dtype=torch.float32, dynamic_size=True)
    from vit_graph_backend.benchmarking.models import primary_output

    with torch.no_grad():
        out = primary_output(built.module(*built.inputs(call, torch.Generator().manual_seed(0))))
    specs = call_specs(entry, call)
    if entry.packed:  # merged tokens, packed: one row per output token of every item
        assert out.shape[0] == sum(s.output_tokens for s in specs)
    else:
        assert out.shape[0] == specs[0].output_tokens == len(call.items)
    assert torch.isfinite(out).all()


@pytest.mark.slow
def test_compile_default_runs_and_matches_eager():
    doc = run_benchmark(BenchConfig(model="vit-micro", workload="fixed-batch",
                                    modes=("eager", "compile-default"), calls=2, max_batch=2,
                                    progress=False))
    eager, compiled = doc["modes"]
    assert compiled["status"] == "ok", compiled["error"]
    assert compiled["max_abs_error"] < 1e-4
    assert compiled["speedup_vs_eager"] > 0 and compiled["backend_report"] is None


def test_packed_vitgraph_mode_matches_eager_and_the_planned_routing():
    pytest.importorskip("vit_graph_backend.packed", reason="packed serving module not present yet")
    if availability(MODELS["qwen2.5-vl-tiny"]) is not None:
        pytest.skip(availability(MODELS["qwen2.5-vl-tiny"]))
    doc = run_benchmark(BenchConfig(model="qwen2.5-vl-tiny", workload="multi-image",
                                    modality="image+video", modes=("eager", "vitgraph"),
                                    calls=3, progress=False))
    eager, vit = doc["modes"]
    assert vit["status"] == "ok", vit["error"]
    assert vit["max_abs_error"] < 1e-4
    measured, planned = vit["backend_report"]["stats"], doc["routing"]["planned"]
    assert measured["batches_per_budget"] == {k: 2 * v for k, v in
                                              planned["batches_per_budget"].items()}
    assert measured["padding_ratio"] == pytest.approx(planned["padding_ratio"])


def test_harness_modules_import_torch_only_inside_functions():
    """``vitgraph plan`` must stay torch-free: no module on its path imports torch at top level."""
    files = [SRC / "cli.py", SRC / "__main__.py", *sorted((SRC / "benchmarking").glob("*.py"))]
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            heavy = [n for n in names if n.split(".")[0] in
                     {"torch", "timm", "transformers", "matplotlib", "tqdm", "numpy"}]
            assert not heavy, f"{path.name} imports {heavy} at module level"


def test_the_first_release_routing_module_warns_and_reexports_the_preview():
    import importlib
    import sys

    from vit_graph_backend import plan_preview

    sys.modules.pop("vit_graph_backend.benchmarking.routing", None)
    with pytest.warns(DeprecationWarning, match="use vit_graph_backend.plan_preview"):
        routing = importlib.import_module("vit_graph_backend.benchmarking.routing")
    assert routing.plan_stream is plan_preview.plan_stream
    assert routing.__all__ == plan_preview.__all__


def test_without_timm_the_default_bench_runs_the_same_shape_from_transformers(monkeypatch):
    """timm is an extra of its own (it pulls torchvision, which pins torch): the README's first
    command must still run, on a model the bench extra provides, and say so."""
    monkeypatch.setitem(sys.modules, "timm", None)  # find_spec("timm") is None: not installed
    run = resolve(BenchConfig(), cuda_available=False)
    assert run.config.model == "clip-tiny"
    (note,) = run.notes
    assert note.startswith("default model vit-micro unavailable (timm is not installed")
    assert note.endswith("ran clip-tiny instead")
    run = resolve(BenchConfig(model="vit-micro"), cuda_available=False)  # asked for: kept
    assert run.config.model == "vit-micro" and run.notes == ()


def test_data_parallel_needs_a_torchrun_launch_and_a_vitgraph_mode(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"needs a torchrun launch .* torchrun --nproc-per-node N"):
        resolve(BenchConfig(data_parallel=True), cuda_available=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="modes eager have none"):
        resolve(BenchConfig(data_parallel=True, modes=("eager",)), cuda_available=False)
    run = resolve(BenchConfig(data_parallel=True, modes=("eager", "vitgraph", "vitgraph-inductor")),
                  cuda_available=False)
    assert run.config.modes == ("eager", "vitgraph", "vitgraph+dp", "vitgraph-inductor",
                                "vitgraph-inductor+dp")


@pytest.mark.parametrize("off", [True, False])
def test_a_run_without_a_bytecode_cache_says_its_first_pass_includes_compiling_imports(
        monkeypatch, off):
    from vit_graph_backend.benchmarking.runner import BYTECODE_NOTE

    monkeypatch.setattr(sys, "dont_write_bytecode", off)
    # a transformers model: the test needs no timm
    doc = run_benchmark(BenchConfig(model="qwen2.5-vl-tiny", workload="multi-image",
                                    modes=("eager",), calls=2, max_batch=2, progress=False))
    assert (BYTECODE_NOTE in doc["notes"]) == off
    assert "PYTHONDONTWRITEBYTECODE" in BYTECODE_NOTE


@pytest.mark.parametrize("job_id", [None, "vitgraph-test"])
def test_a_run_without_a_compile_job_id_says_a_new_process_traces_twice(job_id):
    import torch

    from vit_graph_backend.benchmarking.runner import JOB_ID_NOTE

    with torch.compiler.config.patch(job_id=job_id):
        doc = run_benchmark(BenchConfig(model="qwen2.5-vl-tiny", workload="multi-image",
                                        modes=("eager", "vitgraph"), calls=2, max_batch=2,
                                        progress=False))
        eager_only = run_benchmark(BenchConfig(model="qwen2.5-vl-tiny", workload="multi-image",
                                               modes=("eager",), calls=2, max_batch=2,
                                               progress=False))
    assert (JOB_ID_NOTE in doc["notes"]) == (job_id is None)
    assert "TORCH_COMPILE_JOB_ID" in JOB_ID_NOTE
    assert JOB_ID_NOTE not in eager_only["notes"]   # nothing compiled: nothing to say


def test_the_attention_note_names_the_kernel_and_why_not_cudnn():
    """Served packed towers say in the bench notes which kernel runs their full attention."""
    from types import SimpleNamespace

    from vit_graph_backend.adapters._attention_choice import AttentionChoice

    served = SimpleNamespace(encoder=SimpleNamespace(
        attention_state=AttentionChoice("varlen").state))
    assert attention_note(served) == ("full attention in the graphs: flash varlen "
                                      "(attention='varlen')")
    served.encoder.attention_state = {"segments": "cudnn", "cudnn_off": None}
    assert attention_note(served) == "full attention in the graphs: cudnn"
    assert attention_note(SimpleNamespace()) is None  # a batched mode: no packed encoder


@pytest.mark.parametrize("section, kernel, off, counted", [
    ("full", "triton", "triton_off", ", the Triton segment kernel in {} of {} budgets"),
    ("windows", "short", "short_off", "; window layers: short-segment kernel in {} of {} budgets"),
])
def test_the_attention_note_counts_the_budgets_each_triton_kernel_serves(section, kernel, off,
                                                                        counted):
    from types import SimpleNamespace

    from vit_graph_backend.adapters._attention_choice import AttentionChoice

    state = AttentionChoice("varlen").state
    state[section]["by_rows"] = {256: "varlen", 512: "varlen"}
    served = SimpleNamespace(encoder=SimpleNamespace(attention_state=state))
    assert attention_note(served) == ("full attention in the graphs: flash varlen "
                                      "(attention='varlen')" + counted.format(0, 2)
                                      + " (attention='varlen')")
    state.update(segments="cudnn", cudnn_off=None)
    state[section].update({off: None, "by_rows": {256: kernel, 512: "varlen", 768: kernel}})
    assert attention_note(served) == "full attention in the graphs: cudnn" + counted.format(2, 3)
