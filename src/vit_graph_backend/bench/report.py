"""Result of ``vitgraph bench``: the JSON schema (versioned), the text table and the latency plot.

The JSON document is the one source: the table and the plot are rendered from it, so what is
printed and what is saved cannot disagree. :data:`RESULT_SCHEMA` spells out every key and type of
schema version :data:`SCHEMA_VERSION`; any change to keys or types bumps the version (a test pins
it). :func:`validate` checks a document against it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["RESULT_SCHEMA", "SCHEMA_VERSION", "format_text", "latency_figure", "validate",
           "write_json", "write_plot"]

SCHEMA_VERSION = 8


class _Of:
    def __init__(self, spec: Any) -> None:
        self.spec = spec


class Nullable(_Of):
    """``spec`` or ``null``."""


class ListOf(_Of):
    """A JSON array whose elements all match ``spec``."""


class MapOf(_Of):
    """A JSON object with free string keys whose values all match ``spec``."""


class OneOf:
    """One of the given literal values."""

    def __init__(self, *values: Any) -> None:
        self.values = values


NUMBER = (int, float)
STATS = {  # GraphStats.as_dict(): planned (routing) or measured (backend report)
    "calls": int, "graph_replays": int, "graph_items": int, "no_graph_batches": int,
    "no_graph_items": int, "eager_batches": int, "eager_items": int,
    "exact_shape_batches": int, "real_tokens": int, "padded_tokens": int, "hit_rate": NUMBER,
    "padding_ratio": NUMBER, "batches_per_budget": MapOf(int), "fallback_reasons": MapOf(int),
}
PLAN = {  # plan_preview.plan_to_dict() plus the call index
    "call": int,
    "items": ListOf({"input_size": int, "output_tokens": int, "frames": int}),
    "batches": ListOf({"budget": Nullable(int), "items": ListOf(int), "tokens": int,
                       "padded_tokens": int}),
    "eager_items": ListOf(int), "real_tokens": int, "padded_tokens": int,
    "padding_ratio": NUMBER,
}
MODE = {
    "mode": str, "status": OneOf("ok", "failed"), "error": Nullable(str),
    "traceback": Nullable(str),
    "latency_ms": Nullable({"p50": NUMBER, "p99": NUMBER, "mean": NUMBER, "min": NUMBER,
                            "max": NUMBER}),
    "per_call_ms": ListOf(NUMBER), "stream_total_s": Nullable(NUMBER),
    "first_pass_s": Nullable(NUMBER), "first_pass_phases_s": Nullable(MapOf(NUMBER)),
    "first_call_s": Nullable(NUMBER), "ready_s": Nullable(NUMBER),
    "peak_memory_bytes": Nullable(int),
    "graphs_captured": Nullable(int), "compiles": Nullable(int), "hit_rate": Nullable(NUMBER),
    "padding_ratio": Nullable(NUMBER), "max_abs_error": Nullable(NUMBER),
    "speedup_vs_eager": Nullable(NUMBER), "backend_report": Nullable(dict),
    "rank_busy_s": Nullable(ListOf(NUMBER)), "achieved_tflops": Nullable(NUMBER),
    "fraction_of_peak": Nullable(NUMBER), "notes": ListOf(str),
}
RESULT_SCHEMA: dict[str, Any] = {
    "schema_version": int,
    "tool": str,
    "package_version": str,
    "created_utc": str,
    "environment": {
        "vit_graph_backend": str, "python": str, "platform": str, "cpu_count": int,
        "torch": str, "cuda_available": bool, "cuda_version": Nullable(str), "device": str,
        "device_name": str, "packages": MapOf(Nullable(str)),
    },
    "config": {
        "model": str, "workload": str, "modality": str, "modes": ListOf(str), "calls": int,
        "seed": int, "max_batch": int, "budgets": ListOf(int), "max_budget": Nullable(int),
        "ladder_steps": Nullable(int), "max_items_per_graph": Nullable(int),
        "max_frames_per_batch": Nullable(int), "policy": str, "device": str, "dtype": str,
        "check_calls": int, "progress": bool, "data_parallel": bool, "cold": bool,
        "cache_dir": Nullable(str), "layer_regions": bool, "world_size": int,
        "layout": OneOf("batched", "packed"), "family": str, "params": int, "items": int,
    },
    "routing": {
        "unit": OneOf("rows", "tokens"), "budgets": ListOf(int),
        "max_items_per_graph": Nullable(int), "max_frames_per_batch": Nullable(int),
        "policy": str, "planned": STATS, "sample_plans": ListOf(PLAN),
    },
    "notes": ListOf(str),
    "roofline": Nullable({"stream_flops": int, "flops_per_call": NUMBER, "counter": str,
                          "matmul_peak_tflops": Nullable(NUMBER), "peak_matmul": str}),
    "modes": ListOf(MODE),
}


def _check(value: Any, spec: Any, path: str, problems: list[str]) -> None:
    if isinstance(spec, Nullable):
        if value is not None:
            _check(value, spec.spec, path, problems)
    elif isinstance(spec, OneOf):
        if value not in spec.values:
            problems.append(f"{path}: {value!r} is not one of {spec.values}")
    elif isinstance(spec, ListOf):
        if not isinstance(value, list):
            problems.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        for i, element in enumerate(value):
            _check(element, spec.spec, f"{path}[{i}]", problems)
    elif isinstance(spec, (MapOf, dict)) and not isinstance(value, dict):
        problems.append(f"{path}: expected an object, got {type(value).__name__}")
    elif isinstance(spec, MapOf):
        for key, element in value.items():
            if not isinstance(key, str):
                problems.append(f"{path}: key {key!r} is not a string")
            _check(element, spec.spec, f"{path}.{key}", problems)
    elif isinstance(spec, dict):
        missing, extra = sorted(set(spec) - set(value)), sorted(set(value) - set(spec))
        if missing:
            problems.append(f"{path}: missing keys {missing}")
        if extra:
            problems.append(f"{path}: unexpected keys {extra}")
        for key in set(spec) & set(value):
            _check(value[key], spec[key], f"{path}.{key}", problems)
    else:
        types = spec if isinstance(spec, tuple) else (spec,)
        if isinstance(value, bool) and bool not in types:
            problems.append(f"{path}: expected {spec}, got bool")
        elif not isinstance(value, types):
            problems.append(f"{path}: expected {spec}, got {type(value).__name__}")


def validate(doc: Any, schema: Any = None) -> list[str]:
    """Problems of ``doc`` against ``schema`` (default :data:`RESULT_SCHEMA`); empty if valid."""
    problems: list[str] = []
    _check(doc, RESULT_SCHEMA if schema is None else schema, "$", problems)
    return problems


def write_json(doc: Mapping[str, Any], path: str | Path) -> Path:
    """Write ``doc`` as indented JSON (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


_COLUMNS = ("mode", "status", "p50 ms", "p99 ms", "mean ms", "stream s", "first pass s",
            "peak mem", "graphs", "hit rate", "padding", "max err", "speed-up")


def _num(value: Any, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100.0 * value:.1f} %"


#: The speed-up cell of a run without CUDA, and the one line under the table that says why.
NO_CUDA_SPEEDUP = "n/a (cpu)"
NO_CUDA_SPEEDUP_NOTE = (
    f"speed-up {NO_CUDA_SPEEDUP}: without CUDA no mode replays a graph, so the ratio of stream "
    "times is timing noise, not a speed-up; the JSON keeps the measured ratio "
    "(speedup_vs_eager).")


def _speedup(m: Mapping[str, Any], cuda: bool) -> str:
    if m["speedup_vs_eager"] is None:
        return "n/a"
    return f"{m['speedup_vs_eager']:.2f}x" if cuda else NO_CUDA_SPEEDUP


def _row(m: Mapping[str, Any], cuda: bool) -> tuple[str, ...]:
    if m["status"] != "ok":
        return (m["mode"], "FAILED") + ("-",) * (len(_COLUMNS) - 2)
    lat = m["latency_ms"]
    return (m["mode"], "ok", f"{lat['p50']:.2f}", f"{lat['p99']:.2f}", f"{lat['mean']:.2f}",
            f"{m['stream_total_s']:.3f}", f"{m['first_pass_s']:.2f}",
            _mib(m["peak_memory_bytes"]), _num(m["graphs_captured"], "d"), _pct(m["hit_rate"]),
            _pct(m["padding_ratio"]), _num(m["max_abs_error"], ".1e"), _speedup(m, cuda))


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if c < 2 else cell.rjust(w)
                      for c, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows]


def _budget_counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in counts.items()) or "none"


def _routing_lines(doc: Mapping[str, Any]) -> list[str]:
    from ..plan_preview import plan_line

    r, unit = doc["routing"], doc["routing"]["unit"]
    p = r["planned"]
    cap = (f"{r['max_items_per_graph']} item(s) per graph" if r["max_items_per_graph"] is not None
           else "one row item per call, chunked above the largest budget")
    if r["max_frames_per_batch"] is not None:
        cap += f", {r['max_frames_per_batch']} frames per graph"
    device = str(doc["config"]["device"])
    where = ("" if device.startswith("cuda") else
             f" on a CUDA device; on this {device} each batch runs eagerly at its own size, "
             "without a graph or padding")
    lines = [
        "routing (planner preview: how vitgraph batches these calls with these options):",
        f"  budgets ({unit}): {' '.join(map(str, r['budgets']))} | {cap} | policy {r['policy']}",
        f"  planned over the stream{where}: {p['graph_replays']} replays "
        f"({_budget_counts(p['batches_per_budget'])}), "
        f"{p['eager_batches']} eager batches ({p['eager_items']} items); hit rate "
        f"{_pct(p['hit_rate'])}; padding {_pct(p['padding_ratio'])} "
        f"({p['padded_tokens']} of {p['real_tokens'] + p['padded_tokens']} graph {unit})",
    ]
    lines += [f"  call {plan['call']}: {plan_line(plan, unit=unit)}" for plan in r["sample_plans"]]
    return lines


def _backend_lines(m: Mapping[str, Any]) -> list[str]:
    rep = m["backend_report"]
    s = rep.get("stats", {})
    reasons = s.get("fallback_reasons") or {}
    return [
        f"  {m['mode']}: {_num(rep.get('compiles'), 'd')} Dynamo compiles, "
        f"{rep.get('graphs_captured')} graphs "
        f"({_mib(rep.get('graph_memory_bytes'))}, captured in {rep.get('capture_seconds')} s); "
        f"{s.get('calls')} calls: {s.get('graph_replays')} graph replays, "
        f"{s.get('no_graph_batches') or 0} batches without graphs "
        f"({_budget_counts(s.get('batches_per_budget') or {})}), {s.get('eager_batches')} eager "
        f"batches ({s.get('eager_items')} items); hit rate {_pct(s.get('hit_rate'))}, "
        f"padding {_pct(s.get('padding_ratio'))}; fallbacks: "
        f"{', '.join(f'{k} x{v}' for k, v in reasons.items()) or 'none'}"
    ]


def _first_call(m: Mapping[str, Any]) -> str:
    if m.get("first_call_s") is None or m.get("ready_s") is None:
        return ""
    return f"; first call {m['first_call_s']:.2f}, graphs serving after {m['ready_s']:.2f}"


def _phase_line(p: Mapping[str, float]) -> str:
    return (f"dynamo {p['dynamo']:.2f} + backend {p['backend']:.2f} (inductor "
            f"{p['inductor']:.2f}) + capture {p['capture']:.2f} + other {p['other']:.2f}; "
            f"kernel choices {p['kernel_choices']:.2f}")


def _roofline_lines(doc: Mapping[str, Any]) -> list[str]:
    roof, ok = doc["roofline"], [m for m in doc["modes"] if m["status"] == "ok"]
    lines = []
    if roof is not None:
        peak = roof["matmul_peak_tflops"]
        lines += ["", f"roofline: {roof['flops_per_call'] / 1e9:.2f} GFLOP per call "
                  f"({roof['counter']}, eager stream); matmul peak measured here: "
                  + (f"{peak:.0f} TFLOP/s ({roof['peak_matmul']})" if peak else "n/a (no CUDA)")]
        lines += [f"  {m['mode']}: {_num(m['achieved_tflops'], '.3g')} TFLOP/s"
                  + (f", {m['fraction_of_peak']:.2f} of peak" if m["fraction_of_peak"] else "")
                  for m in ok]
    for m in ok:
        busy = m["rank_busy_s"]
        if busy:
            lines.append(f"  {m['mode']}: busy s per rank {', '.join(f'{b:.3f}' for b in busy)}; "
                         f"imbalance {(max(busy) - min(busy)) / max(max(busy), 1e-12):.1%} of the "
                         "busiest")
    return lines


def format_text(doc: Mapping[str, Any]) -> str:
    """The human-readable report of a result document."""
    env, cfg = doc["environment"], doc["config"]
    lines = [
        f"vitgraph bench: {cfg['model']} ({cfg['family']}, {cfg['layout']}, "
        f"{cfg['params'] / 1e6:.2f} M params, random weights) | workload {cfg['workload']}, "
        f"modality {cfg['modality']}, {cfg['calls']} calls ({cfg['items']} items), "
        f"seed {cfg['seed']}",
        f"device {env['device']} ({env['device_name']}) | {cfg['dtype']} | torch {env['torch']} "
        f"| vit_graph_backend {env['vit_graph_backend']}",
    ]
    lines += [f"note: {note}" for note in doc["notes"]]
    lines += [""] + _routing_lines(doc) + [""]
    cuda = str(env["device"]).startswith("cuda")
    lines += _table([_COLUMNS] + [_row(m, cuda) for m in doc["modes"]])
    if not cuda and any(m["speedup_vs_eager"] is not None for m in doc["modes"]):
        lines.append(NO_CUDA_SPEEDUP_NOTE)
    failed = [m for m in doc["modes"] if m["status"] != "ok"]
    if failed:
        lines += ["", "failed modes (the run went on):"]
        lines += [f"  {m['mode']}: {m['error']}" for m in failed]
    phased = [m for m in doc["modes"] if m["status"] == "ok" and m["mode"] != "eager"
              and m.get("first_pass_phases_s")]
    if phased:
        lines += ["", "first pass until graphs serve, by phase, s (dynamo: tracing and guards; "
                  "backend: its compile, Inductor's included; capture: warm-up runs and "
                  "captures; kernel choices run inside the backend or a capture, and a served "
                  "tower's compiles inside its captures):"]
        lines += [f"  {m['mode']}: {m.get('ready_s') or m['first_pass_s']:.2f} = " + _phase_line(
            m["first_pass_phases_s"]) + _first_call(m) for m in phased]
    reported = [m for m in doc["modes"] if m["backend_report"]]
    if reported:
        lines += ["", "vitgraph backend reports (counts cover the first and the timed pass):"]
        for m in reported:
            lines += _backend_lines(m)
    lines += _roofline_lines(doc)
    noted = [(m["mode"], n) for m in doc["modes"] for n in m["notes"]]
    lines += [f"note ({mode}): {n}" for mode, n in noted]
    lines += [
        "",
        "p50/p99/mean: per call, timed pass. stream s: sum of the timed pass. first pass s: wall "
        "time of the first run of the stream (compiles and captures included).",
        f"max err: max |mode - eager| over the first {cfg['check_calls']} calls. speed-up: eager "
        "stream s / mode stream s. peak mem: torch.cuda.max_memory_allocated (n/a on CPU).",
    ]
    return "\n".join(lines)


def _readable_log_axis(ax: Any, values: list[float]) -> None:
    """A log y axis with labelled ticks (spread linearly over less than a decade)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter, ScalarFormatter

    ax.set_yscale("log")
    positive = [v for v in values if v > 0]
    if positive and max(positive) < 10 * min(positive):
        ax.yaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    else:
        ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())


def latency_figure(doc: Mapping[str, Any]) -> Any:
    """The latency distribution of each mode that ran, as a matplotlib ``Figure``: a box plot per
    mode (left) and per-call latency along the stream (right), log y axes. Needs matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [m for m in doc["modes"] if m["status"] == "ok"]
    cfg, env = doc["config"], doc["environment"]
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    box, line = fig.subplots(1, 2, width_ratios=(1, 2))
    if ok:
        box.boxplot([m["per_call_ms"] for m in ok], tick_labels=[m["mode"] for m in ok])
        for m in ok:
            line.plot(range(len(m["per_call_ms"])), m["per_call_ms"], label=m["mode"], lw=1)
        line.legend(fontsize="small")
        values = [v for m in ok for v in m["per_call_ms"]]
        for ax in (box, line):
            _readable_log_axis(ax, values)
    else:
        box.text(0.5, 0.5, "no mode ran", ha="center", va="center", transform=box.transAxes)
    box.set_ylabel("latency per call (ms)")
    box.tick_params(axis="x", labelrotation=30)
    line.set_xlabel("call (timed pass)")
    fig.suptitle(f"{cfg['model']} | {cfg['workload']} ({cfg['modality']}) | {env['device_name']} "
                 f"| {cfg['dtype']} | torch {env['torch']}", fontsize="medium")
    return fig


def write_plot(doc: Mapping[str, Any], path: str | Path) -> Path:
    """Save :func:`latency_figure` as a PNG (parent folders created); returns the path."""
    fig = latency_figure(doc)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    return path
