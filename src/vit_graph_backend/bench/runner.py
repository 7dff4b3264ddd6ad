"""``vitgraph bench``: one model, one seeded stream, several modes side by side in one process.

Per mode: ``torch.compiler.reset()`` (and the peak-memory counter on CUDA); a **first pass** over
the stream, its wall time (compiles, captures) reported; a **timed pass**, each call timed
(p50/p99/mean, stream total; *speed-up* is eager's stream total over the mode's); the first
``check_calls`` outputs compared with eager (max abs error); vitgraph modes add their report,
counting both passes. A mode that raises is reported as failed and the run goes on. The routing
preview comes from the planner alone (:mod:`vit_graph_backend.plan_preview`), so it shows on any
machine.

Defaults depend on the device: on CPU a tiny model, 24 calls, ``eager,vitgraph``, fp32; on CUDA
``vit-b16``, 120 calls (60 for packed models), the default modes, bf16.
"""

from __future__ import annotations

import datetime
import sys
import traceback
from dataclasses import asdict, dataclass, replace
from typing import Any

from .. import __version__, plan_preview
from ..budgets import BudgetConfig
from ..options import VitGraphOptions
from .attention_note import attention_note
from .environment import collect_environment
from .models import MODELS, ModelEntry, availability, build_model, call_specs, primary_output
from .distributed import (DP_SUFFIX, LAUNCH_HINT, gather_floats, init_world, launched,
                          start_together)
from .modes import DEFAULT_MODES, MODES, VITGRAPH_MODES, backend_report, prepare_mode, reset
from .report import SCHEMA_VERSION
from .roofline import PEAK_SIDE, count_stream_flops, fraction_of_peak, matmul_peak_tflops
from .timing import CallTimer, progress, summarize
from .workloads import WORKLOADS, Call, make_stream, resolve_modality

__all__ = ["DTYPES", "BenchConfig", "Resolved", "resolve", "run_benchmark"]

DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
CPU_NOTE = (
    "no CUDA device: CUDA graphs need a CUDA device. On CPU the vitgraph modes plan each call "
    "as on a GPU and run every batch eagerly at its own size (no graphs, no padding), so these "
    "timings show the routing's overhead, not the speed-up; run the same command on a CUDA "
    "machine for the real numbers."
)
BYTECODE_NOTE = (
    "Python writes no bytecode cache here (PYTHONDONTWRITEBYTECODE or -B): every process compiles "
    "the modules it imports from source, and Dynamo's and Inductor's modules, imported at the "
    "first compile, land in the first pass (docs/performance.md, first pass)."
)
JOB_ID_NOTE = (
    "torch.compiler.config.job_id is unset (TORCH_COMPILE_JOB_ID): Dynamo keeps no profile of "
    "which dimensions turned dynamic, so every new process traces a compiled model twice (first "
    "call static, then with a dynamic batch); with a job id a process after the first traces it "
    "once, in its first call (docs/performance.md, first pass)."
)


@dataclass(frozen=True)
class BenchConfig:
    """What the user asked for; ``None`` means "the default for the device" (see module doc)."""

    model: str | None = None
    workload: str = "uniform-batch"
    modality: str | None = None
    modes: tuple[str, ...] | None = None
    calls: int | None = None
    seed: int = 0
    max_batch: int | None = None
    budgets: tuple[int, ...] | None = None
    max_budget: int | None = None
    ladder_steps: int | None = None
    max_items_per_graph: int | None = None
    max_frames_per_batch: int | None = None
    policy: str = "baseline"
    device: str | None = None
    dtype: str | None = None
    check_calls: int = 3
    progress: bool = True
    data_parallel: bool = False  # under torchrun: each vitgraph mode also as <mode>+dp
    cold: bool = False  # Inductor's and Triton's caches empty: a first pass as in a new machine
    cache_dir: str | None = None  # use_cache_dir(cache_dir): what a process keeps for the next
    layer_regions: bool = False  # mark_layer_regions(model) before the compiled modes


@dataclass(frozen=True)
class Resolved:
    """A config with every default filled in, its stream and the routing it implies."""

    config: BenchConfig  # no None left in model/modality/modes/calls/max_batch/device/dtype
    entry: ModelEntry
    stream: list[Call]
    budgets: BudgetConfig
    notes: tuple[str, ...] = ()  # what resolution chose for the user, said in the report

    @property
    def vitgraph_options(self) -> dict[str, Any]:
        """The backend options of the vitgraph modes (each adds its inner compiler)."""
        options: dict[str, Any] = {"budgets": list(self.budgets.budgets),
                                   "policy": self.config.policy}
        if self.entry.packed:
            options["max_items_per_graph"] = self.budgets.max_batch_size
            if self.budgets.max_frames_per_batch is not None:
                options["max_frames_per_batch"] = self.budgets.max_frames_per_batch
        return options


def resolve(config: BenchConfig, *, cuda_available: bool) -> Resolved:
    """Fill in device-dependent defaults and check the combination; torch is not imported.

    Raises:
        ValueError: naming the bad value (unknown model, workload or mode, a clash of modality
            and model); budget options raise ``InvalidOptionError`` (a ``ValueError``) from
            ``VitGraphOptions``, as ``serve`` and ``torch.compile`` would.
    """
    device = config.device or ("cuda" if cuda_available else "cpu")
    cuda = device.startswith("cuda")
    if cuda and not cuda_available:
        raise ValueError(f"device={device!r} is invalid: CUDA is not available on this machine")
    model, notes = config.model, []
    if model is None:
        model = "vit-b16" if cuda else "vit-micro"
        missing = availability(MODELS[model])
        if missing is not None:
            # timm needs torchvision, which the extras leave out: the same ViT from transformers
            model = "clip-b16" if cuda else "clip-tiny"
            notes.append(f"default model {'vit-b16' if cuda else 'vit-micro'} unavailable "
                         f"({missing}): ran {model} instead")
    if model not in MODELS:
        raise ValueError(f"model={model!r} is invalid: choose from {', '.join(MODELS)}")
    entry = MODELS[model]
    if config.workload not in WORKLOADS:
        raise ValueError(
            f"workload={config.workload!r} is invalid: choose from {', '.join(WORKLOADS)}")
    modes = config.modes or (DEFAULT_MODES if cuda else ("eager", "vitgraph"))
    if config.cold and config.cache_dir is not None:
        raise ValueError(f"cache_dir={config.cache_dir!r} is invalid with cold=True: a cold run "
                         "starts from a new empty folder; choose one")
    if config.data_parallel:  # resolving a resolved config again gives it back
        modes = tuple(dict.fromkeys(m.removesuffix(DP_SUFFIX) for m in modes))
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is invalid: choose from {', '.join(MODES)}")
        if mode == "vitgraph-compile-background" and entry.packed:
            raise ValueError(f"mode={mode!r} is invalid for the packed model {model!r}: a served "
                             "tower's first call holds no Dynamo trace; use vitgraph-background")
    if config.data_parallel:
        if not launched():
            raise ValueError(LAUNCH_HINT)
        if not any(m in VITGRAPH_MODES for m in modes):
            raise ValueError(f"data_parallel=True runs the vitgraph modes data-parallel; modes "
                             f"{','.join(modes)} have none")
        modes = [n for m in modes for n in ((m, m + DP_SUFFIX) if m in VITGRAPH_MODES else (m,))]
    dtype = config.dtype or ("bfloat16" if cuda else "float32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: choose from {', '.join(DTYPES)}")
    modality = resolve_modality(config.workload, config.modality, packed=entry.packed)
    max_batch = config.max_batch or (4 if entry.packed else (32 if cuda else 8))
    calls = config.calls or ((60 if entry.packed else 120) if cuda else 24)
    stream = make_stream(config.workload, modality, entry.space, calls=calls, seed=config.seed,
                         max_batch=max_batch)
    specs = [call_specs(entry, call) for call in stream]
    budget_config = _resolve_budgets(config, entry, modality, specs)  # InvalidOptionError
    resolved = replace(config, model=model, modality=modality, modes=tuple(modes), calls=calls,
                       max_batch=max_batch, device=device, dtype=dtype,
                       budgets=budget_config.budgets,
                       max_items_per_graph=budget_config.max_batch_size if entry.packed else None)
    return Resolved(resolved, entry, stream, budget_config, tuple(notes))


def stream_budget_range(calls: list[list[int]], max_items_per_graph: int) -> tuple[int, int]:
    """The budget range a packed stream needs: from the largest power of two not above the
    smallest item (at least ``max_items_per_graph``) to the largest sum of
    ``max_items_per_graph`` items of one call."""
    tokens = [t for call in calls for t in call]
    if not tokens:
        raise ValueError("the stream has no items")
    stop = max(sum(sorted(call)[-max_items_per_graph:]) for call in calls if call)
    start = min(max(1 << (min(tokens).bit_length() - 1), max_items_per_graph), stop)
    return start, stop


def _resolve_budgets(config: BenchConfig, entry: ModelEntry, modality: str,
                     specs: list[list[Any]]) -> BudgetConfig:
    """The bench's options, resolved as the runtime does; only the range comes from the stream."""
    if not entry.packed:
        rows = max(s.output_tokens for call in specs for s in call)
        options = VitGraphOptions(budgets=config.budgets, max_budget=config.max_budget or rows,
                                  ladder_steps=config.ladder_steps,
                                  max_items_per_graph=config.max_items_per_graph,
                                  max_frames_per_batch=config.max_frames_per_batch)
        return options.resolve(batched=True)  # refuses the packed-only options
    items = config.max_items_per_graph or (2 if modality == "image+video" else 1)
    frames = config.max_frames_per_batch
    if frames is None and modality != "image":
        # without a frame cap, capture assumes a frame per item and videos run eagerly
        frames = max(sum(sorted(s.frames for s in call)[-items:]) for call in specs)
    options = VitGraphOptions(budgets=config.budgets, max_budget=config.max_budget,
                              ladder_steps=config.ladder_steps, max_items_per_graph=items,
                              max_frames_per_batch=frames)
    return options.resolve(stream_budget_range(
        [[s.output_tokens for s in call] for call in specs], items))


def _routing_section(run: Resolved) -> dict[str, Any]:
    entry, cfg = run.entry, run.config
    specs = [call_specs(entry, call) for call in run.stream]
    plans = plan_preview.plan_stream(specs, run.budgets, policy=cfg.policy, chunk=not entry.packed)
    return {
        "unit": "tokens" if entry.packed else "rows",
        "budgets": list(run.budgets.budgets),
        "max_items_per_graph": run.budgets.max_batch_size if entry.packed else None,
        "max_frames_per_batch": run.budgets.max_frames_per_batch,
        "policy": cfg.policy,
        "planned": plan_preview.summarize_plans(plans, run.budgets),
        "sample_plans": [{"call": i, **plan_preview.plan_to_dict(plans[i], specs[i])}
                         for i in range(min(3, len(plans)))],
    }


def _mode_result(name: str) -> dict[str, Any]:
    return {"mode": name, "status": "failed", "error": None, "traceback": None,
            "latency_ms": None, "per_call_ms": [], "stream_total_s": None, "first_pass_s": None,
            "first_call_s": None, "ready_s": None, "first_pass_phases_s": None,
            "peak_memory_bytes": None, "graphs_captured": None, "compiles": None,
            "hit_rate": None, "padding_ratio": None, "max_abs_error": None,
            "speedup_vs_eager": None, "backend_report": None, "rank_busy_s": None,
            "achieved_tflops": None, "fraction_of_peak": None, "notes": []}


def _use_caches(cfg: BenchConfig) -> str | None:
    """Point this process's caches (:func:`~vit_graph_backend.cache_dir.use_cache_dir`) at
    ``cfg.cache_dir``, or for ``cfg.cold`` at a new empty folder removed when the process ends;
    the note that says so. The caller runs before any compile."""
    import atexit
    import shutil
    import tempfile

    from ..cache_dir import use_cache_dir

    if not cfg.cold:
        if cfg.cache_dir is None:
            return None
        used = use_cache_dir(cfg.cache_dir)
        if used is None:
            return f"cache_dir: the caches stay as they were: {cfg.cache_dir} was refused"
        return f"cache_dir: compiled kernels and kernel choices read from and kept in {used}"
    folder = tempfile.mkdtemp(prefix="vitgraph-cold-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    used = use_cache_dir(folder)
    if used is None:   # use_cache_dir warned why
        return f"cold: the caches stay as they were: {folder} was refused"
    return (f"cold: Inductor's and Triton's caches start empty in {used}, removed at exit "
            "(Python's bytecode and the CUDA driver's caches stay as they are); a run without "
            "--cold uses the caches earlier runs without it filled")


def _phase_counters() -> dict[str, float]:
    from .. import _compat
    from ..runtime.timing import kernel_timing_seconds

    return {**_compat.compile_phase_seconds(), "kernel_choices": kernel_timing_seconds()}


def _first_pass_phases(before: dict[str, float], total: float,
                       report: dict[str, Any] | None) -> dict[str, float]:
    """The first pass's seconds (until graphs serve: with ``capture="background"`` the wait for
    the preparation too) by phase, each from its own timer: ``dynamo`` (tracing and
    guards), ``backend`` (the backend's compile, ``inductor``'s included), ``kernel_choices``
    (kernel candidates timed, inside the backend's compile or a capture), ``capture`` (warm-up
    runs and graph captures, kernel choices included) and ``other`` (the rest: eager runs,
    planning, staging). A compile inside a capture (a served tower's fused ops: Dynamo and its
    backend) counts in both."""
    after = _phase_counters()
    phases = {key: round(after[key] - before[key], 3) for key in after}
    phases["capture"] = round(float((report or {}).get("capture_seconds") or 0.0), 3)
    spent = phases["dynamo"] + phases["backend"] + phases["capture"]
    phases["other"] = round(max(0.0, total - spent), 3)
    return phases


def _max_abs_error(out: Any, ref: Any) -> float | None:
    got = primary_output(out).detach().float().cpu()
    if got.shape != ref.shape:
        return None
    return float((got - ref).abs().max()) if got.numel() else 0.0


def _run_mode(name: str, run: Resolved, built: Any, inputs: list[tuple[Any, ...]],
              refs: list[Any], timer: CallTimer) -> dict[str, Any]:
    import torch

    result = _mode_result(name)
    show = run.config.progress
    prepared = None
    try:
        if timer.cuda:
            torch.cuda.reset_peak_memory_stats(timer.device)
        prepared = prepare_mode(name.removesuffix(DP_SUFFIX), built, run.vitgraph_options)
        parallel = None
        if name.endswith(DP_SUFFIX):
            from ..integrations.parallel import data_parallel

            parallel = prepared.fn = data_parallel(prepared.fn, record_busy=True)

        def first_pass() -> None:
            for i, args in enumerate(progress(inputs, desc=f"{name}: first pass (compile, "
                                              "capture)", total=len(inputs), enabled=show)):
                if i == 0:
                    _, result["first_call_s"] = timer.wall(lambda: prepared.fn(*args))
                else:
                    prepared.fn(*args)

        with torch.no_grad():
            before = _phase_counters()
            _, result["first_pass_s"] = timer.wall(first_pass)
            # capture="background": the first pass may end before the graphs serve
            waited = timer.wall(prepared.wait)[1] if prepared.wait is not None else 0.0
            result["ready_s"] = result["first_pass_s"] + waited
            # phases until the graphs serve (a background preparation's included)
            result["first_pass_phases_s"] = _first_pass_phases(
                before, result["ready_s"], backend_report(prepared))
            if parallel is not None:
                parallel.busy_seconds()  # the first pass's shares are not the timed pass's
            ms, errors = [], []
            for i, args in enumerate(progress(inputs, desc=f"{name}: timed pass",
                                              total=len(inputs), enabled=show)):
                if parallel is not None:
                    start_together()
                out, elapsed = timer.time_call(prepared.fn, args)
                ms.append(elapsed)
                if i < len(refs):
                    errors.append(_max_abs_error(out, refs[i]))
                del out
        result.update(status="ok", latency_ms=summarize(ms), per_call_ms=ms,
                      stream_total_s=sum(ms) / 1e3)
        if parallel is not None:
            result["rank_busy_s"] = gather_floats(parallel.busy_seconds())
        if None in errors:
            result["notes"].append("output shape differs from eager: no equivalence check")
        elif errors:
            result["max_abs_error"] = max(errors)
        if timer.cuda:
            result["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(timer.device))
            if (note := attention_note(prepared.fn)) is not None:
                result["notes"].append(note)
        report = backend_report(prepared)
        if report is not None:
            stats = report.get("stats", {})
            result.update(backend_report=report, graphs_captured=report.get("graphs_captured"),
                          compiles=report.get("compiles"), hit_rate=stats.get("hit_rate"),
                          padding_ratio=stats.get("padding_ratio"))
    except Exception as exc:  # a failing mode is a result, not the end of the run
        result.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:2000],
                      traceback=traceback.format_exc()[-8000:])
    finally:
        reset(prepared)
    return result


def _roofline(fn: Any, inputs: list[tuple[Any, ...]], device: str, dtype: Any,
              notes: list[str]) -> dict[str, Any] | None:
    """Stream FLOPs and the matmul peak (``roofline``); ``None`` with a note if uncountable."""
    try:
        flops = count_stream_flops(fn, inputs)
    except Exception as exc:  # the counter is a report, never the end of the run
        notes.append(f"no FLOP count: {type(exc).__name__}: {exc}"[:300])
        return None
    return {"stream_flops": flops, "flops_per_call": flops / max(len(inputs), 1),
            "counter": "torch.utils.flop_counter.FlopCounterMode",
            "matmul_peak_tflops": matmul_peak_tflops(device, dtype),
            "peak_matmul": f"{PEAK_SIDE}^3 {str(dtype).removeprefix('torch.')}"}


def run_benchmark(config: BenchConfig) -> dict[str, Any]:
    """Run the benchmark and return its JSON-ready result (see :mod:`.report` for the schema).

    Raises:
        ValueError: for a bad configuration (before anything runs).
        RuntimeError: if the model is unavailable here.
    """
    import torch

    run = resolve(config, cuda_available=torch.cuda.is_available())
    cfg, entry = run.config, run.entry
    reason = availability(entry)
    if reason is not None:
        raise RuntimeError(f"model {entry.name!r} is unavailable here: {reason}")
    cache_note = _use_caches(cfg)
    world = 1
    if cfg.data_parallel:
        _, world, device = init_world(cfg.device)
        run = replace(run, config=replace(cfg, device=device))
        cfg = run.config
    dtype = getattr(torch, cfg.dtype)
    sizes = {(i.height, i.width) for call in run.stream for i in call.items}
    built = build_model(entry, device=cfg.device, dtype=dtype, dynamic_size=len(sizes) > 1,
                        seed=cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    inputs = [built.inputs(call, generator) for call in run.stream]
    timer = CallTimer(cfg.device)

    with torch.no_grad():  # eager reference for the equivalence check
        refs = [primary_output(built.module(*args)).detach().float().cpu()
                for args in inputs[: cfg.check_calls]]

    notes = list(run.notes) + ([] if timer.cuda else [CPU_NOTE]) + (
        [cache_note] if cache_note else [])
    if sys.dont_write_bytecode:
        notes.append(BYTECODE_NOTE)
    if (getattr(torch.compiler.config, "job_id", None) is None
            and any(name in VITGRAPH_MODES for name in cfg.modes)):
        notes.append(JOB_ID_NOTE)
    roof = _roofline(built.module, inputs, cfg.device, dtype, notes)
    if cfg.layer_regions:   # after the eager reference and the FLOP count: regions change no op
        from ..compile.regions import mark_layer_regions

        notes.append(f"layer_regions: {mark_layer_regions(built.module)} layers marked as "
                     "nested compile regions, for every compiled mode")
    modes = [_run_mode(name, run, built, inputs, refs, timer) for name in cfg.modes]
    eager = next((m for m in modes if m["mode"] == "eager" and m["status"] == "ok"), None)
    for m in modes:
        if eager is not None and m["status"] == "ok" and m["stream_total_s"]:
            m["speedup_vs_eager"] = eager["stream_total_s"] / m["stream_total_s"]
        if roof is not None and m["status"] == "ok":
            gpus = world if m["mode"].endswith(DP_SUFFIX) else 1  # +dp: the world's peak
            peak = roof["matmul_peak_tflops"] * gpus if roof["matmul_peak_tflops"] else None
            m["achieved_tflops"], m["fraction_of_peak"] = fraction_of_peak(
                roof["stream_flops"], m["stream_total_s"], peak)

    items = sum(len(call.items) for call in run.stream)
    config_block = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()}
    config_block.update(layout=entry.layout, family=entry.family, params=built.num_params,
                        items=items, world_size=world)
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "vitgraph bench",
        "package_version": __version__,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": collect_environment(cfg.device),
        "config": config_block,
        "routing": _routing_section(run),
        "notes": notes,
        "roofline": roof,
        "modes": modes,
    }

