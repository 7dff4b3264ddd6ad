"""CLIP ViT-L/14-336 where the kernels set the time: one call of 8, 24 or 48 images, per mode,
with the fraction of the GPU's bf16 matmul peak it reaches (model FLOPs over the call's time and
the peak measured in the same run).

Modes (random weights, bf16, one process): ``eager``; ``vitgraph`` (the defaults: Inductor
inside the graphs); ``vitgraph-batch-invariant`` (``batch_invariant=True``: the traced kernels,
nothing chosen by timing; its cost against the default); ``inductor-static``
(``torch.compile(mode="reduce-overhead", dynamic=False)``: Inductor and a CUDA graph per exact
shape, the best PyTorch offers for a fixed batch). Calls alternate between modes round by round.

Usage: python benchmarks/clip_peak.py [--rounds 20] [--batches 8,24,48]. A table to stdout and
``$OUT/clip_peak.txt``.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch

from vit_graph_backend.bench.models import MODELS, build_model
from vit_graph_backend.bench.roofline import count_stream_flops, matmul_peak_tflops

MODES = ("eager", "vitgraph", "vitgraph-batch-invariant", "inductor-static")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batches", default="8,24,48")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model = build_model(MODELS["clip-l14-336"], device="cuda", dtype=torch.bfloat16,
                        dynamic_size=False).module
    fns = {"eager": model,
           "vitgraph": torch.compile(model, backend="vitgraph"),
           "vitgraph-batch-invariant": torch.compile(model, backend="vitgraph",
                                                     options={"batch_invariant": True}),
           "inductor-static": torch.compile(model, mode="reduce-overhead", dynamic=False)}
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = {b: torch.randn(b, 3, 336, 336, device="cuda", dtype=torch.bfloat16, generator=gen)
              for b in batches}
    peak = matmul_peak_tflops("cuda", torch.bfloat16)
    flops = {b: count_stream_flops(model, [(inputs[b],)]) for b in batches}
    times: dict[tuple[str, int], list[float]] = {}
    errors: dict[str, float] = {}
    with torch.inference_mode():
        refs = {b: model(inputs[b]).float() for b in batches}
        for r in range(args.rounds + 3):   # three rounds of compiles, captures and warm-up
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                for b in batches:
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize()
                    start.record()
                    out = fns[mode](inputs[b])
                    end.record()
                    end.synchronize()
                    if r >= 3:
                        times.setdefault((mode, b), []).append(start.elapsed_time(end))
                    elif r == 2:
                        diff = (out.float() - refs[b]).abs().max().item()
                        errors[mode] = max(errors.get(mode, 0.0), diff)
    lines = [f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, bf16, CLIP "
             f"ViT-L/14-336 (random weights); bf16 matmul peak measured here {peak:.0f} "
             f"TFLOP/s; p50 ms of {args.rounds} rounds, (fraction of peak)",
             f"{'images':>6}" + "".join(f"{m:>28}" for m in MODES)]
    for b in batches:
        cells = []
        for mode in MODES:
            ms = statistics.median(times[(mode, b)])
            cells.append(f"{ms:>19.2f} ({flops[b] / (ms / 1e3) / 1e12 / peak:.2f})")
        lines.append(f"{b:>6}" + "".join(f"{c:>28}" for c in cells))
    lines.append("largest difference from eager (bf16): " + ", ".join(
        f"{m} {errors[m]:.3g}" for m in MODES if m in errors))
    print("\n".join(lines))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "clip_peak.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
