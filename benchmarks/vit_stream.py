"""ViT stream: timm ViT-B/16, bf16, a stream of 120 calls with batch sizes uniform in 1..32.

Modes side by side in one process: eager, torch.compile default, mode="reduce-overhead",
vitgraph (eager inner), vitgraph (inductor inner). For each: first pass (the whole stream once,
compiles and captures included), then per-call latency over ``--repeats`` further passes of the
same stream (wall clock around each call, CUDA synchronized): p50/p99/mean over all timed calls
(360 by default, so p99 is not the second-worst of 120), stream total as the median pass, peak
memory, graphs captured, padding ratio. ``vitgraph-doubling`` is the previous default ladder
(1, 2, 4, ..., 32 rows), measured beside the current one (4 steps per doubling). Writes JSON to $OUT (else the working directory).

Usage: python benchmarks/vit_stream.py [--calls 120] [--model vit_base_patch16_224]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
import traceback
from pathlib import Path

import torch

from vit_graph_backend.bench.timing import percentile


def run_mode(name, model, stream, dtype, repeats=3):
    from vit_graph_backend.compile.backend import vitgraph

    torch.compiler.reset()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    if name == "eager":
        fn = model
    elif name == "compile-default":
        fn = torch.compile(model)
    elif name == "reduce-overhead":
        fn = torch.compile(model, mode="reduce-overhead")
    elif name == "vitgraph":
        fn = torch.compile(model, backend="vitgraph")
    elif name == "vitgraph-doubling":  # session 1's default ladder: 1, 2, 4, ..., 32 rows
        fn = torch.compile(model, backend="vitgraph", options={"ladder_steps": 1})
    elif name == "vitgraph-inductor":
        fn = torch.compile(model, backend="vitgraph", options={"inner_compiler": "inductor"})
    else:
        raise ValueError(name)
    inputs = {b: torch.randn(b, 3, 224, 224, device="cuda", dtype=dtype) for b in set(stream)}
    result = {"mode": name}
    try:
        with torch.inference_mode():
            t0 = time.perf_counter()
            first_out = {}
            for b in stream:
                out = fn(inputs[b])
                if b not in first_out:
                    first_out[b] = out.float().clone()
            torch.cuda.synchronize()
            result["first_pass_s"] = time.perf_counter() - t0
            lat, totals = [], []
            for _ in range(repeats):
                t_all = time.perf_counter()
                for b in stream:
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    fn(inputs[b])
                    torch.cuda.synchronize()
                    lat.append((time.perf_counter() - t) * 1e3)
                totals.append((time.perf_counter() - t_all) * 1e3)
            result["stream_total_ms"] = statistics.median(totals)
            result["stream_totals_ms"] = totals
            result.update(p50_ms=percentile(lat, 50), p99_ms=percentile(lat, 99),
                          mean_ms=statistics.fmean(lat))
            result["peak_memory_mib"] = torch.cuda.max_memory_allocated() / 2**20
            result["outputs"] = first_out
            if name.startswith("vitgraph"):
                rep = vitgraph.report()
                result.update(graphs_captured=rep["graphs_captured"], compiles=rep["compiles"],
                              padding_ratio=rep["stats"]["padding_ratio"],
                              hit_rate=rep["stats"]["hit_rate"],
                              graph_memory_mib=rep["graph_memory_bytes"] / 2**20,
                              capture_s=rep["capture_seconds"])
    except Exception as exc:  # a failing mode is reported, the run goes on
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        traceback.print_exc()
    return result


def exact_graph_ms(model, dtype, batch, reps=50):
    """Reference floor: one CUDA graph captured at exactly this batch, replay time only."""
    x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=dtype)
    with torch.inference_mode():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                model(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            model(x)
        g.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    del g
    return (time.perf_counter() - t) / reps * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=120)
    ap.add_argument("--model", default="vit_base_patch16_224")
    ap.add_argument("--modes", default="eager,vitgraph-doubling,vitgraph,vitgraph-inductor,"
                    "compile-default,reduce-overhead")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes over the stream")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import timm

    torch.manual_seed(0)
    dtype = torch.bfloat16
    model = timm.create_model(args.model, pretrained=False).cuda().to(dtype).eval()
    rng = random.Random(args.seed)
    stream = [rng.randint(1, 32) for _ in range(args.calls)]
    results = []
    ref = None
    for mode in args.modes.split(","):
        r = run_mode(mode, model, stream, dtype, args.repeats)
        outs = r.pop("outputs", None)
        if mode == "eager":
            ref = outs
        elif outs and ref:
            r["max_abs_err_vs_eager"] = max((outs[b] - ref[b]).abs().max().item() for b in outs)
        results.append(r)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    torch.compiler.reset()
    floors = {b: exact_graph_ms(model, dtype, b) for b in (1, 8, 32)}
    print("exact-shape graph replay ms:", {b: round(v, 3) for b, v in floors.items()})
    meta = {"benchmark": "vit_stream", "exact_graph_ms": floors, "model": args.model, "dtype": "bfloat16",
            "calls": args.calls, "repeats": args.repeats, "seed": args.seed, "batch_sizes": "uniform 1..32",
            "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cuda": torch.version.cuda, "results": results}
    tag = torch.cuda.get_device_name(0).replace("NVIDIA ", "").split()[0]
    name = f"vit_b16_stream_latency_{tag}_torch{torch.__version__.split('+')[0]}.json"
    for folder in [Path(os.environ.get("OUT", "."))]:
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(json.dumps(meta, indent=2))
    ok = {r["mode"]: r for r in results if "error" not in r}
    eager, ro = ok.get("eager"), ok.get("reduce-overhead")
    print(f"\n{'mode':<20}{'p50 ms':>9}{'p99 ms':>9}{'total ms':>10}{'first s':>9}{'peak MiB':>10}"
          f"{'graphs':>7}{'pad':>6}{'p99/eager':>10}{'p99/RO':>8}{'tot/eager':>10}")
    for r in results:
        if "error" in r:
            print(f"{r['mode']:<20} FAILED: {r['error']}")
            continue
        nan = float("nan")
        print(f"{r['mode']:<20}{r['p50_ms']:9.2f}{r['p99_ms']:9.2f}{r['stream_total_ms']:10.1f}"
              f"{r['first_pass_s']:9.1f}{r['peak_memory_mib']:10.0f}{r.get('graphs_captured', '-'):>7}"
              f"{r.get('padding_ratio', 0):6.2f}"
              f"{r['p99_ms'] / eager['p99_ms'] if eager else nan:10.2f}"
              f"{r['p99_ms'] / ro['p99_ms'] if ro else nan:8.2f}"
              f"{r['stream_total_ms'] / eager['stream_total_ms'] if eager else nan:10.2f}")


if __name__ == "__main__":
    main()
