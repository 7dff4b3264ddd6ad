"""The attention settings side by side in one process, on single-image streams of large towers:
flash varlen always (``attention="varlen"``), the default (cuDNN segment attention where
``nvidia-cudnn-frontend`` is installed, else flash varlen), full attention chosen per budget at
capture (``"auto"``), and HF eager.

Models (``vit_graph_backend.bench.models``, random weights, bf16): ``qwen3-vl-8b`` (the
Qwen3-VL-8B vision tower's shape, images up to 1312 px: the largest are GPU-bound) and
``qwen2.5-vl`` (the Qwen2.5-VL-3B tower). Stream: ``vitgraph bench``'s ``mixed-sizes`` workload
(one image per call, its size drawn per call, seed 0). Both served modes use
``max_items_per_graph=1``, as the bench does for single images, so every budget holds one image
and its full attention is one segment plus padding.

A third run puts every image of ``qwen3-vl-8b`` at 1312 x 1312 px with the one budget that fits
it exactly (``budgets=[1681]``), where dense attention computes no padding: ``"varlen"``, the
default and ``"dense"``, beside eager.

Reports per mode p50/p99/mean ms and stream seconds of the second pass (CUDA-synchronized calls),
the first pass, the p99 against eager's, and the kernel each budget got with the timings that
chose it. Usage: python benchmarks/attention_choice_stream.py [--models qwen3-vl-8b,qwen2.5-vl]
[--calls 40]. Text to stdout and $OUT/attention_choice_stream.txt, JSON beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from _bench_out import emit
from qwen_stream import pct

from vit_graph_backend import serve
from vit_graph_backend.bench.models import MODELS, build_model
from vit_graph_backend.bench.timing import CallTimer
from vit_graph_backend.bench.workloads import make_stream


def timed_pass(fn, inputs):
    """Wall ms of each call between device syncs."""
    timer = CallTimer("cuda")
    return [timer.wall(lambda args=args: fn(*args))[1] * 1e3 for args in inputs]


def two_passes(fn, inputs):
    """``(first pass s, each call's ms of the second pass)``: the first pass compiles and
    captures, the second is the one reported."""
    t0 = time.perf_counter()
    timed_pass(fn, inputs)
    first = time.perf_counter() - t0
    return first, timed_pass(fn, inputs)


def run_model(name: str, calls: int, fixed: bool = False) -> dict:
    entry = MODELS[name]
    built = build_model(entry, device="cuda", dtype=torch.bfloat16, dynamic_size=True)
    if fixed:  # every image 1312 x 1312 px: 41 x 41 = 1681 tokens
        from vit_graph_backend.bench.workloads import Call, Item

        stream = [Call((Item(1312, 1312),))] * calls
    else:
        stream = make_stream("mixed-sizes", "image", entry.space, calls=calls, seed=0,
                             max_batch=1)
    gen = torch.Generator().manual_seed(0)
    inputs = [built.inputs(call, gen) for call in stream]
    tower = built.module
    modes = {"eager": tower}
    budgets = {"budgets": [1681]} if fixed else {}
    for setting in ("varlen", None, "dense" if fixed else "auto"):
        label = f"vitgraph {setting or 'default'}"
        modes[label] = serve(tower, max_items_per_graph=1, attention=setting, **budgets)
    result = {"model": name + (", 1312 px, budgets=[1681]" if fixed else ""),
              "params": built.num_params, "calls": calls, "modes": {}}
    with torch.inference_mode():
        for mode, fn in modes.items():
            first, times = two_passes(fn, inputs)
            row = {"p50_ms": statistics.median(times), "p99_ms": pct(times, 99),
                   "mean_ms": statistics.fmean(times), "stream_s": sum(times) / 1e3,
                   "first_pass_s": first}
            if mode != "eager":
                row["attention"] = fn.encoder.attention_state
                row["eager_items"] = fn.manager.stats.eager_items
            result["modes"][mode] = row
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="qwen3-vl-8b,qwen2.5-vl")
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    results = [run_model(name, args.calls) for name in args.models.split(",")]
    if "qwen3-vl-8b" in args.models.split(","):
        results.append(run_model("qwen3-vl-8b", 20, fixed=True))
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; single-image "
             f"stream (mixed-sizes, seed 0), {args.calls} calls, second pass timed; bf16"]
    for res in results:
        eager = res["modes"]["eager"]
        lines += ["", f"{res['model']} ({res['params'] / 1e6:.0f} M params)",
                  f"{'mode':<17}{'p50 ms':>8}{'p99 ms':>8}{'mean ms':>9}{'stream s':>9}"
                  f"{'first s':>9}{'p99/eager':>10}"]
        for mode, row in res["modes"].items():
            lines.append(f"{mode:<17}{row['p50_ms']:8.2f}{row['p99_ms']:8.2f}{row['mean_ms']:9.2f}"
                         f"{row['stream_s']:9.3f}{row['first_pass_s']:9.2f}"
                         f"{row['p99_ms'] / eager['p99_ms']:10.2f}")
        default = res["modes"]["vitgraph default"]["attention"]
        lines.append(f"vitgraph default: segments {default['segments']} {default['cudnn']}")
        last = list(res["modes"].values())[-1]["attention"]
        lines.append(f"{list(res['modes'])[-1]} kernels by static rows: {last['by_rows']}")
        lines.append(f"timings ms: {last['timings_ms']}")
    emit(lines, "attention_choice_stream")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "attention_choice_stream.json").write_text(
            json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                        "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
