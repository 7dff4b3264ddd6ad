"""The ``vitgraph bench`` harness: the result schema, the models and the modes, the notes a run adds.

CPU only. The registry's tiny models are built and run once each; ``compile-default`` is run on one
static shape (one Inductor compile, marked ``slow``); the packed vitgraph path runs on a tiny
Qwen2.5-VL tower. Workloads, defaults, routing and timing: ``test_benchmarking.py``.
"""

from __future__ import annotations

import ast
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vit_graph_backend
from vit_graph_backend.bench import (
    MODELS,
    RESULT_SCHEMA,
    SCHEMA_VERSION,
    BenchConfig,
    resolve,
    run_benchmark,
    validate,
)
from vit_graph_backend.bench.models import availability, build_model, call_specs
from vit_graph_backend.bench.attention_note import attention_note
from vit_graph_backend.bench.workloads import make_stream

SRC = Path(vit_graph_backend.__file__).resolve().parent
TINY = [name for name in MODELS if name.endswith("-tiny") or name == "vit-micro"]

# -- JSON schema ---------------------------------------------------------------------------------

#: Schema version 8, frozen here: changing the document's keys must bump SCHEMA_VERSION.
#: (v2 = v1 plus config.ladder_steps; v3: the option names max_items_per_graph and
#: max_frames_per_batch, and the stats of report()'s graph/no-graph counts; v4: the roofline,
#: each mode's achieved TFLOP/s, fraction of peak and per-rank busy seconds, data parallelism;
#: v5: each mode's first pass by phase, config.cold; v6: each mode's first call and the time
#: until its graphs serve; v7: config.cache_dir; v8: config.layer_regions.)
V1_TOP = {"schema_version", "tool", "package_version", "created_utc", "environment", "config",
          "routing", "notes", "modes", "roofline"}
V1_MODE = {"mode", "status", "error", "traceback", "latency_ms", "per_call_ms", "stream_total_s",
           "first_pass_s", "peak_memory_bytes", "graphs_captured", "compiles", "hit_rate",
           "padding_ratio", "max_abs_error", "speedup_vs_eager", "backend_report", "notes",
           "rank_busy_s", "achieved_tflops", "fraction_of_peak", "first_pass_phases_s",
           "first_call_s", "ready_s"}
V1_CONFIG = {"model", "workload", "modality", "modes", "calls", "seed", "max_batch", "budgets",
             "max_budget", "ladder_steps", "max_items_per_graph", "max_frames_per_batch",
             "policy", "device", "dtype", "check_calls", "progress", "layout", "family",
             "params", "items", "data_parallel", "cold", "cache_dir", "layer_regions",
             "world_size"}
V1_ROUTING = {"unit", "budgets", "max_items_per_graph", "max_frames_per_batch", "policy",
              "planned", "sample_plans"}
V3_STATS = {"calls", "graph_replays", "graph_items", "no_graph_batches", "no_graph_items",
            "eager_batches", "eager_items", "exact_shape_batches", "real_tokens",
            "padded_tokens", "hit_rate", "padding_ratio", "batches_per_budget",
            "fallback_reasons"}


def test_schema_v7_is_pinned():
    assert SCHEMA_VERSION == 8
    assert set(RESULT_SCHEMA["routing"]["planned"]) == V3_STATS
    assert set(RESULT_SCHEMA) == V1_TOP
    assert set(RESULT_SCHEMA["modes"].spec) == V1_MODE
    assert set(RESULT_SCHEMA["config"]) == V1_CONFIG
    assert set(RESULT_SCHEMA["routing"]) == V1_ROUTING


@pytest.fixture(scope="module")
def eager_doc():
    return run_benchmark(BenchConfig(model="clip-tiny", modes=("eager",), calls=3, max_batch=3,
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
    from vit_graph_backend.bench.models import primary_output

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
    doc = run_benchmark(BenchConfig(model="clip-tiny", workload="fixed-batch",
                                    modes=("eager", "compile-default"), calls=2, max_batch=2,
                                    progress=False))
    eager, compiled = doc["modes"]
    assert compiled["status"] == "ok", compiled["error"]
    assert compiled["max_abs_error"] < 1e-4
    assert compiled["speedup_vs_eager"] > 0 and compiled["backend_report"] is None


def test_packed_vitgraph_mode_matches_eager_and_the_planned_routing(padded_cpu):
    pytest.importorskip("vit_graph_backend.adapters.serve", reason="packed serving module not present yet")
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


@pytest.mark.slow
def test_a_torchvision_that_fails_beside_this_torch_is_named_in_one_line_and_set_aside(
        tmp_path):
    """PyPI's torchvision beside a CPU build of torch fails at import ("operator torchvision::nms
    does not exist"), and takes timm and transformers' model imports with it. The bench names it
    in one note and runs its transformers default. Here a stand-in torchvision fails the same way
    beside a stand-in timm that needs it, in a fresh interpreter."""
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n")
    (tmp_path / "timm").mkdir()
    (tmp_path / "timm" / "__init__.py").write_text("import torchvision.ops\n")
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    done = subprocess.run([sys.executable, "-m", "vit_graph_backend", "bench", "--calls", "2",
                           "--max-batch", "2", "--no-progress", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["config"]["model"] == "clip-tiny"
    notes = [n for n in doc["notes"] if "torchvision" in n]
    assert len(notes) == 1, doc["notes"]
    note = notes[0]
    assert "timm cannot run here: torchvision does not import beside torch" in note
    assert "operator torchvision::nms does not exist" in note and "\n" not in note


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
    from vit_graph_backend.bench.runner import BYTECODE_NOTE

    monkeypatch.setattr(sys, "dont_write_bytecode", off)
    # a transformers model: the test needs no timm
    doc = run_benchmark(BenchConfig(model="qwen2.5-vl-tiny", workload="multi-image",
                                    modes=("eager",), calls=2, max_batch=2, progress=False))
    assert (BYTECODE_NOTE in doc["notes"]) == off
    assert "PYTHONDONTWRITEBYTECODE" in BYTECODE_NOTE


@pytest.mark.parametrize("job_id", [None, "vitgraph-test"])
def test_a_run_without_a_compile_job_id_says_a_new_process_traces_twice(job_id):
    import torch

    from vit_graph_backend.bench.runner import JOB_ID_NOTE

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

    from vit_graph_backend.kernels.attention_choice import AttentionChoice

    served = SimpleNamespace(encoder=SimpleNamespace(
        attention_state=AttentionChoice("varlen").state))
    assert attention_note(served) == ("full attention in the graphs: flash varlen "
                                      "(packed_attention='varlen')")
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

    from vit_graph_backend.kernels.attention_choice import AttentionChoice

    state = AttentionChoice("varlen").state
    state[section]["by_rows"] = {256: "varlen", 512: "varlen"}
    served = SimpleNamespace(encoder=SimpleNamespace(attention_state=state))
    assert attention_note(served) == ("full attention in the graphs: flash varlen "
                                      "(packed_attention='varlen')" + counted.format(0, 2)
                                      + " (packed_attention='varlen')")
    state.update(segments="cudnn", cudnn_off=None)
    state[section].update({off: None, "by_rows": {256: kernel, 512: "varlen", 768: kernel}})
    assert attention_note(served) == "full attention in the graphs: cudnn" + counted.format(2, 3)
