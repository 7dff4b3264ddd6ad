"""The ``vitgraph`` command end to end on CPU: bench (JSON, plot, failed modes), plan, info, errors.

Everything runs on CPU with ``vit-micro`` and a handful of calls; the file takes well under 90 s on
two cores. ``plan`` values are checked against numbers computed here, independently of the planner.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from vit_graph_backend import __version__
from vit_graph_backend.bench import SCHEMA_VERSION, validate
from vit_graph_backend.cli import main

FAST = ["--model", "clip-tiny", "--calls", "4", "--max-batch", "4", "--no-progress"]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _exit_code(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


# -- bench ---------------------------------------------------------------------------------------


def test_bench_eager_writes_valid_json_and_a_png(tmp_path, capsys):
    json_path, png_path = tmp_path / "r" / "bench.json", tmp_path / "bench.png"
    code, out, _ = _run(capsys, "bench", *FAST, "--modes", "eager", "--json", str(json_path),
                        "--plot", str(png_path))
    assert code == 0
    assert "CUDA graphs need a CUDA device" in out  # said plainly on CPU
    assert "budgets (rows): 1 2 3 4" in out  # routing preview (batched default ladder)
    doc = json.loads(json_path.read_text())
    assert validate(doc) == []
    assert doc["schema_version"] == SCHEMA_VERSION == 8
    (eager,) = doc["modes"]
    assert eager["status"] == "ok" and len(eager["per_call_ms"]) == 4
    assert eager["max_abs_error"] == 0.0 and eager["speedup_vs_eager"] == pytest.approx(1.0)
    assert eager["peak_memory_bytes"] is None  # CPU: n/a
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(png_path).ndim == 3


def test_a_failing_mode_is_reported_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    import vit_graph_backend.compile.backend as backend_module

    class Broken(backend_module.VitGraphBackend):   # its compile fails, the rest is the backend's
        def __call__(self, gm, example_inputs, **kwargs):
            raise RuntimeError("a backend broken for this test")

    monkeypatch.setattr(backend_module, "vitgraph", Broken())   # the vitgraph mode compiles with it
    path = tmp_path / "r.json"
    code, out, _ = _run(capsys, "bench", *FAST, "--modes", "vitgraph,eager", "--json", str(path))
    assert code == 0
    assert "FAILED" in out and "broken for this test" in out
    doc = json.loads(path.read_text())
    assert validate(doc) == []
    failed, eager = doc["modes"]
    assert (failed["mode"], failed["status"]) == ("vitgraph", "failed")
    assert "broken for this test" in failed["error"] and failed["latency_ms"] is None
    assert eager["status"] == "ok"  # the run went on after the failure
    assert main(["bench", *FAST, "--modes", "vitgraph", "--strict"]) == 1


def test_vitgraph_mode_runs_and_matches_eager(tmp_path, capsys):
    pytest.importorskip("vit_graph_backend.compile.backend", reason="backend module not present yet")
    path = tmp_path / "r.json"
    code, out, _ = _run(capsys, "bench", *FAST, "--workload", "uniform-batch",
                        "--modes", "eager,vitgraph", "--json", str(path))
    assert code == 0
    doc = json.loads(path.read_text())
    eager, vit = doc["modes"]
    assert vit["status"] == "ok", vit["error"]
    assert vit["max_abs_error"] < 1e-4
    stats = vit["backend_report"]["stats"]
    assert stats["calls"] == 2 * doc["config"]["calls"]  # first pass + timed pass
    assert vit["hit_rate"] == stats["hit_rate"]
    assert "vitgraph backend reports" in out


def test_cache_dir_keeps_compiled_kernels_in_the_named_folder(tmp_path, capsys, monkeypatch):
    """``--cache-dir PATH``: Inductor's and Triton's caches in PATH, said in a note; the compile
    job id left as it was."""
    import os

    import torch

    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):   # restored after the test
        monkeypatch.setenv(var, str(tmp_path / var))
    path = tmp_path / "r.json"
    with torch.compiler.config.patch(job_id=None):
        code, _, _ = _run(capsys, "bench", *FAST, "--workload", "uniform-batch", "--modes",
                          "vitgraph", "--cache-dir", str(tmp_path / "keep"), "--json", str(path))
        assert torch.compiler.config.job_id is None
    assert code == 0
    doc = json.loads(path.read_text())
    assert doc["config"]["cache_dir"] == str(tmp_path / "keep") and not doc["config"]["cold"]
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert os.environ[var].startswith(str(tmp_path / "keep")), os.environ[var]
    assert any(f"kept in {tmp_path / 'keep'}" in note for note in doc["notes"]), doc["notes"]


def test_layer_regions_marks_the_models_layers_before_the_compiled_modes(tmp_path, capsys):
    path = tmp_path / "r.json"
    code, _, _ = _run(capsys, "bench", *FAST, "--modes", "eager,vitgraph", "--layer-regions",
                      "--json", str(path))
    assert code == 0
    doc = json.loads(path.read_text())
    assert doc["config"]["layer_regions"] is True
    assert "layer_regions: 2 layers marked as nested compile regions" in " ".join(doc["notes"])
    assert [m["status"] for m in doc["modes"]] == ["ok", "ok"]
    assert doc["modes"][1]["max_abs_error"] < 1e-4


def test_compile_background_mode_answers_then_compiles_and_is_refused_for_packed_towers(
        tmp_path, capsys):
    from vit_graph_backend.bench.runner import BenchConfig, resolve
    from vit_graph_backend.compile.background import COMPILING

    path = tmp_path / "r.json"
    code, _, _ = _run(capsys, "bench", *FAST, "--modes", "eager,vitgraph-compile-background",
                      "--json", str(path))
    assert code == 0
    mode = json.loads(path.read_text())["modes"][1]
    assert mode["status"] == "ok" and mode["max_abs_error"] < 1e-4
    assert mode["backend_report"]["stats"]["fallback_reasons"][COMPILING] >= 1
    assert mode["ready_s"] >= mode["first_call_s"]

    with pytest.raises(ValueError, match="mode='vitgraph-compile-background' is invalid for "
                                         "the packed model 'qwen2-vl-tiny'"):
        resolve(BenchConfig(model="qwen2-vl-tiny", modes=("vitgraph-compile-background",)),
                cuda_available=False)


def test_cold_and_cache_dir_are_one_choice(tmp_path, capsys):
    from vit_graph_backend.bench.runner import BenchConfig, resolve

    with pytest.raises(SystemExit):
        main(["bench", *FAST, "--cold", "--cache-dir", str(tmp_path)])
    assert "not allowed with argument --cold" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cache_dir=.* is invalid with cold=True"):
        resolve(BenchConfig(cold=True, cache_dir=str(tmp_path)), cuda_available=False)
    assert not any(tmp_path.iterdir())   # refused before anything was made


def test_cold_first_pass_is_split_into_phases(tmp_path, capsys, monkeypatch):
    """``--cold``: Inductor's and Triton's caches move to a new owner-only folder, and the
    vitgraph mode's first pass is told by phase, each phase from its own timer."""
    import os
    import stat

    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):   # restored after the test
        monkeypatch.setenv(var, str(tmp_path / var))
    path = tmp_path / "r.json"
    code, out, _ = _run(capsys, "bench", *FAST, "--workload", "uniform-batch", "--cold",
                        "--modes", "eager,vitgraph", "--json", str(path))
    assert code == 0
    doc = json.loads(path.read_text())
    assert doc["config"]["cold"] is True
    folder = os.path.dirname(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert folder != str(tmp_path) and any(folder in note for note in doc["notes"])
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    vit = doc["modes"][1]
    phases = vit["first_pass_phases_s"]
    assert set(phases) == {"dynamo", "backend", "inductor", "kernel_choices", "capture", "other"}
    assert phases["dynamo"] > 0 and phases["backend"] > 0, phases   # vitgraph traced here
    assert all(v >= 0 for v in phases.values()), phases
    assert phases["dynamo"] + phases["backend"] <= vit["first_pass_s"] + 1e-3, phases
    assert "first pass until graphs serve, by phase" in out
    # the first call alone, and the wait for graphs (none here: captured in the calls)
    assert 0 < vit["first_call_s"] <= vit["first_pass_s"] <= vit["ready_s"], vit
    assert "first call" in out


def test_enable_vit_cuda_graph_picks_the_single_mode(capsys):
    pytest.importorskip("vit_graph_backend.compile.backend", reason="backend module not present yet")
    code, out, _ = _run(capsys, "bench", *FAST, "--enable-vit-cuda-graph")
    assert code == 0
    table = out[out.index("mode  "):]
    assert "vitgraph" in table and "\neager" not in table


def test_no_enable_vit_cuda_graph_runs_eager_only(capsys):
    code, out, _ = _run(capsys, "bench", *FAST, "--no-enable-vit-cuda-graph")
    assert code == 0
    table = out[out.index("mode  "):].splitlines()
    assert [line.split()[0] for line in table[1:2]] == ["eager"]
    assert "vitgraph " not in "\n".join(table[1:3])


def test_list(capsys):
    code, out, _ = _run(capsys, "bench", "--list")
    assert code == 0
    for name in ("vit-micro", "vit-b16", "qwen2.5-vl", "uniform-batch", "video", "reduce-overhead"):
        assert name in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["bench", "--model", "nope"], "invalid choice: 'nope'"),
        (["bench", "--workload", "bursty"], "invalid choice: 'bursty'"),
        (["bench", "--modes", "eager,fast"], "invalid mode: 'fast'"),
        (["bench", "--modes", "eager,eager"], "a mode is repeated"),
        (["bench", "--calls", "0"], "invalid positive integer: '0'"),
        (["bench", "--calls", "many"], "invalid positive integer: 'many'"),
        (["bench", "--budgets", "1,x"], "invalid positive integer: 'x'"),
        (["bench", "--device", "tpu"], "invalid device: 'tpu'"),
        (["bench", "--dtype", "float8"], "invalid choice: 'float8'"),
        (["bench", "--modality", "audio"], "invalid choice: 'audio'"),
        (["bench", "--modes", "eager", "--enable-vit-cuda-graph"], "not allowed with --modes"),
        (["bench", "--model", "clip-tiny", "--modality", "video"], "needs a packed"),
        (["bench", "--model", "qwen2-vl-tiny", "--workload", "video", "--modality", "image"],
         "streams videos"),
        (["bench", "--model", "clip-tiny", "--max-items-per-graph", "2"],
             "max_items_per_graph=2 does not apply to torch.compile"),
        (["bench", "--model", "qwen2-vl-tiny", "--budgets", "2,8", "--max-items-per-graph", "4"],
         "max_items_per_graph=4 is larger than the smallest budget"),
        (["plan"], "one of the arguments --items --sizes is required"),
        (["plan", "--items", "100", "--sizes", "28x28"], "not allowed with argument"),
        (["plan", "--sizes", "450x448"], "450x448 is not a multiple of patch*merge"),
        (["plan", "--sizes", "448by448"], "invalid size: '448by448'"),
        (["plan", "--items", "100", "--budgets", "64", "--max-items-per-graph", "128"],
         "max_items_per_graph=128 is larger than the smallest budget"),
        (["plan", "--items", "-3"], "invalid positive integer: '-3'"),
        (["plan", "--items", "3", "--ladder-steps", "17"], "invalid ladder steps: '17'"),
        (["bench", "--ladder-steps", "0"], "invalid positive integer: '0'"),
        ([], "the following arguments are required"),
    ],
)
def test_bad_arguments_exit_2_naming_the_value(capsys, argv, needle):
    code, _, err = _exit_code(capsys, *argv)
    assert code == 2
    assert needle in err
    assert "usage: vitgraph" in err


def test_version(capsys):
    code, out, _ = _exit_code(capsys, "--version")
    assert code == 0
    assert out.strip() == f"vitgraph {__version__}"


# -- plan ----------------------------------------------------------------------------------------


def test_plan_text_matches_a_hand_computed_plan(capsys):
    # Baseline by hand: items sorted by tokens 50(#4) 60(#1) 100(#0) 300(#2) 2000(#3), 2 per graph,
    # token sums within the largest budget 1024: [#4, #1] = 110 -> budget 256 (146 padding);
    # [#0, #2] = 400 -> budget 1024 (624 padding); #3 = 2000 > 1024 -> eager.
    code, out, _ = _run(capsys, "plan", "--budgets", "1024,64,256", "--max-items-per-graph", "2",
                        "--items", "100,60,300,2000,50")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "budget ladder (tokens): 64 256 1024 (3 graphs)"
    rows = [line.split() for line in lines if line.strip()[:1].isdigit() and "#" not in line]
    assert rows == [["0", "256", "4,1", "110", "146"], ["1", "1024", "0,2", "400", "624"],
                    ["2", "eager", "3", "2000", "-"]]
    waste = 146 + 624
    assert f"padding waste: {waste} of {110 + 400 + waste} graph tokens" in out
    assert f"({100 * waste / (510 + waste):.1f} %)" in out and "eager: 1 item (#3)" in out


def test_plan_sizes_use_patch_and_merge(capsys):
    code, out, _ = _run(capsys, "plan", "--sizes", "448x448,224x336", "--patch", "14",
                        "--merge", "2", "--max-budget", "1024", "--ladder-steps", "1", "--json")
    assert code == 0
    doc = json.loads(out)
    # 448/14 = 32 -> 1024 patches -> 16*16 = 256 tokens; 224x336 -> 16*24 = 384 patches -> 96.
    assert [(i["input_size"], i["output_tokens"]) for i in doc["items"]] == [(1024, 256), (384, 96)]
    assert doc["budgets"] == [64, 128, 256, 512, 1024]  # doubling from 64, ending at 1024
    assert doc["max_items_per_graph"] == 16  # neither given: min(1024 // 64, 64)
    ((batch),) = doc["batches"]  # both fit one graph: 352 tokens -> budget 512
    assert (batch["budget"], sorted(batch["items"]), batch["padded_tokens"]) == (512, [0, 1], 160)


def test_plan_default_ladder_splits_each_doubling(capsys):
    code, out, _ = _run(capsys, "plan", "--items", "352", "--max-budget", "1024", "--json")
    assert code == 0
    doc = json.loads(out)
    # packed default: 64 * (1, 1.5, 2, 3, 4, 6, 8, 12), then 1024; 352 tokens -> budget 384
    assert doc["budgets"] == [64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert doc["batches"][0]["budget"] == 384 and doc["padded_tokens"] == 32
    code, out, _ = _run(capsys, "plan", "--items", "13", "--min-budget", "1", "--max-budget",
                        "32", "--chunk", "--json")
    assert json.loads(out)["budgets"] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32]


def test_plan_chunked_rows(capsys):
    code, out, _ = _run(capsys, "plan", "--items", "13", "--budgets", "1,2,4,8", "--chunk",
                        "--json")
    assert code == 0
    doc = json.loads(out)
    assert sorted(b["tokens"] for b in doc["batches"]) == [5, 8]  # one full chunk + remainder
    assert doc["padded_tokens"] == 3 and doc["eager_items"] == []


def test_plan_counts_eager_items_and_names_their_indices(capsys):
    # one item over the default largest budget: "eager items: 0" read as "no item"
    code, out, _ = _run(capsys, "plan", "--items", "5000")
    assert code == 0
    assert "eager: 1 item (#0)" in out and "eager items: 0" not in out
    code, out, _ = _run(capsys, "plan", "--items", "5000,30,6000", "--max-budget", "1024")
    assert "eager: 2 items (#0, #2)" in out
    code, out, _ = _run(capsys, "plan", "--items", "30")
    assert "eager: none" in out


@pytest.mark.parametrize("layout", [[], ["--chunk"]], ids=["packed", "chunked"])
def test_plan_with_only_a_small_max_budget_starts_the_ladder_below_it(capsys, layout):
    """As the options do at run time: a lone max_budget under the default start lowers it."""
    code, out, err = _run(capsys, "plan", *layout, "--items", "20", "--max-budget", "8",
                          "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert max(doc["budgets"]) == 8 and min(doc["budgets"]) <= 8
    if layout:  # rows: cut into chunks that fit the ladder
        assert doc["eager_items"] == [] and sum(b["tokens"] for b in doc["batches"]) == 20
    else:  # one packed item of 20 tokens is over the largest budget
        assert doc["eager_items"] == [0]
    code, out, err = _run(capsys, "plan", *layout, "--items", "20", "--min-budget", "8000",
                          "--json")
    assert code == 0, err
    assert min(json.loads(out)["budgets"]) == 8000
    code, _, err = _exit_code(capsys, "plan", *layout, "--items", "20", "--min-budget", "100",
                              "--max-budget", "50")
    assert code == 2 and "min_budget=100 is larger than max_budget=50" in err


def _baseline(tokens: list[int], budgets: list[int], max_items: int) -> list[tuple[int, ...]]:
    """An independent transcription of the baseline policy of ``planner.py``'s docstring."""
    order = sorted(range(len(tokens)), key=lambda i: (tokens[i], i))
    batches, current, total, eager = [], [], 0, []
    for i in order:
        if tokens[i] > max(budgets):
            eager.append((i,))
            continue
        if current and (total + tokens[i] > max(budgets) or len(current) == max_items):
            batches.append(tuple(current))
            current, total = [], 0
        current.append(i)
        total += tokens[i]
    if current:
        batches.append(tuple(current))
    return batches + eager


@pytest.mark.parametrize("seed", range(5))
def test_plan_json_matches_an_independent_baseline(capsys, seed):
    rng = random.Random(seed)
    tokens = [rng.randint(1, 1500) for _ in range(rng.randint(1, 12))]
    budgets = sorted(rng.sample([16, 32, 64, 128, 256, 512, 1024], 4))
    max_items = rng.randint(1, budgets[0])
    code, out, _ = _run(capsys, "plan", "--items", ",".join(map(str, tokens)), "--budgets",
                        ",".join(map(str, budgets)), "--max-items-per-graph", str(max_items), "--json")
    assert code == 0
    doc = json.loads(out)
    expected = _baseline(tokens, budgets, max_items)
    assert [tuple(b["items"]) for b in doc["batches"]] == expected
    for batch in doc["batches"]:
        total = sum(tokens[i] for i in batch["items"])
        fitting = [b for b in budgets if b >= total]
        assert batch["budget"] == (fitting[0] if fitting else None)
        assert batch["padded_tokens"] == (fitting[0] - total if fitting else 0)


def test_plan_never_imports_torch():
    code = ("import sys, vit_graph_backend; pre = 'torch' in sys.modules; "
            "from vit_graph_backend.cli import main; main(['plan', '--items', '256,1024']); "
            "print(pre, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "budget ladder" in result.stdout
    package_imports_torch, torch_after_plan = result.stdout.split()[-2:]
    assert package_imports_torch == "False", "import vit_graph_backend imported torch"
    assert torch_after_plan == "False", "vitgraph plan imported torch"


# -- info and python -m ----------------------------------------------------------------------------


def test_info_reports_versions_cuda_and_backend(capsys):
    code, out, _ = _run(capsys, "info", "--json")
    assert code == 0
    doc = json.loads(out)
    env, backend = doc["environment"], doc["backend"]
    assert env["vit_graph_backend"] == __version__
    import torch

    assert env["torch"] == torch.__version__
    assert env["cuda_available"] == torch.cuda.is_available()
    assert backend["listed"] == ("vitgraph" in torch.compiler.list_backends(exclude_tags=()))
    assert set(env["packages"]) >= {"timm", "transformers", "matplotlib", "tqdm"}
    code, out, _ = _run(capsys, "info")
    assert "backend 'vitgraph'" in out and "CUDA" in out


def test_python_dash_m_matches_the_console_script():
    result = subprocess.run([sys.executable, "-m", "vit_graph_backend", "--version"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"vitgraph {__version__}"


# -- one name per setting: --help flags are the option names ------------------------------------

#: Flags that are not settings of VitGraphOptions (the harness's own, vLLM's on/off switch for
#: encoder graphs, plan's inputs).
NOT_OPTIONS = {"--items", "--sizes", "--max-batch", "--enable-vit-cuda-graph",
               "--no-enable-vit-cuda-graph"}
#: Words that mark a flag as a setting: such a flag must be spelled as its option field.
SETTING_WORDS = ("item", "frame", "budget", "ladder", "step", "graph", "polic")


def _visible_flags(subcommand: str) -> dict[str, str]:
    import argparse

    from vit_graph_backend.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {flag: action.dest for action in sub.choices[subcommand]._actions
            if action.help is not argparse.SUPPRESS
            for flag in action.option_strings if flag.startswith("--")}


@pytest.mark.parametrize("patch", [2, 4, 14])
def test_plan_shows_the_ladder_a_served_tower_of_that_patch_size_uses(capsys, patch):
    """``vitgraph plan --patch P --merge 2`` and a served tower of patch P agree on the ladder."""
    pytest.importorskip("transformers")
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    import vit_graph_backend

    tower = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(
        depth=1, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=24,
        patch_size=patch, window_size=4 * patch, fullatt_block_indexes=[0])).eval()
    served = vit_graph_backend.serve(tower)
    code, out, _ = _run(capsys, "plan", "--items", "24", "--patch", str(patch), "--merge", "2",
                        "--json")
    assert code == 0
    assert json.loads(out)["budgets"] == list(served.manager.config.budgets)
