"""The Qwen3-VL-8B-shaped tower's single-image stream with its MLPs' ``fc1`` + tanh GELU as one
op (``epilogue_fusion="auto"``, the default) against the tower's own modules
(``epilogue_fusion="off"``), beside HF eager, in one process.

Stream: ``vitgraph bench``'s ``mixed-sizes`` workload (one image per call, up to 1312 px, seed 0;
the largest images are GPU-bound), then every image at 1312 x 1312 px with ``budgets=[1681]``.
Both served modes use ``max_items_per_graph=1`` as the bench does for single images. The default
mode runs again last, so the spread between its two runs shows the machine's drift.

Reports per mode p50/p99/mean ms and stream seconds of the second pass (CUDA-synchronized
calls), the first pass, and p99 against eager's. Usage: python benchmarks/gelu_fusion_stream.py
[--calls 40]. Text to stdout and $OUT/gelu_fusion_stream.txt.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _bench_out import emit
from attention_choice_stream import two_passes
from qwen_stream import pct

from vit_graph_backend import serve
from vit_graph_backend.bench.models import MODELS, build_model
from vit_graph_backend.bench.workloads import Call, Item, make_stream


def run(calls: int, fixed: bool) -> list[str]:
    entry = MODELS["qwen3-vl-8b"]
    built = build_model(entry, device="cuda", dtype=torch.bfloat16, dynamic_size=True)
    stream = ([Call((Item(1312, 1312),))] * calls if fixed else
              make_stream("mixed-sizes", "image", entry.space, calls=calls, seed=0, max_batch=1))
    gen = torch.Generator().manual_seed(0)
    inputs = [built.inputs(call, gen) for call in stream]
    tower = built.module
    extra = {"budgets": [1681]} if fixed else {}
    default = serve(tower, max_items_per_graph=1, **extra)
    modes = {"eager": tower, "vitgraph default": default,
             "vitgraph epilogue off": serve(tower, max_items_per_graph=1,
                                            epilogue_fusion="off", **extra),
             "vitgraph default again": default}
    lines = ["", f"qwen3-vl-8b{', 1312 px, budgets=[1681]' if fixed else ''}: {calls} calls",
             f"{'mode':<24}{'p50 ms':>8}{'p99 ms':>8}{'mean ms':>9}{'stream s':>9}"
             f"{'first s':>9}{'p99/eager':>10}"]
    eager_p99 = None
    with torch.inference_mode():
        for mode, fn in modes.items():
            first, times = two_passes(fn, inputs)
            p99 = pct(times, 99)
            eager_p99 = eager_p99 or p99
            lines.append(f"{mode:<24}{statistics.median(times):8.2f}{p99:8.2f}"
                         f"{statistics.fmean(times):9.2f}{sum(times) / 1e3:9.3f}{first:9.2f}"
                         f"{p99 / eager_p99:10.2f}")
    lines.append(f"default: MLP activation through the fused op: {default.encoder.kernels.epilogue}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    from vit_graph_backend.kernels.fused_linear import CHOICES

    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; bf16, random "
             "weights; second pass timed"]
    lines += run(args.calls, fixed=False)
    lines += run(max(10, args.calls // 2), fixed=True)
    lines += ["", "fused_linear choices (shape: what was timed fastest):"]
    lines += [f"  {shape}: {choice}" for shape, choice in CHOICES.state["chosen"].items()]
    emit(lines, "gelu_fusion_stream")


if __name__ == "__main__":
    main()
