"""The Qwen stream benchmark: the Qwen2.5-VL-3B-shaped vision tower (depth 32, hidden 1280, 16 heads,
intermediate 3420, out hidden 2048, patch 14, merge 2, window 112, full attention at blocks
7/15/23/31; random weights, bf16) on (a) 60 single-image calls with sides uniform in 224..896 px in
steps of 28 (seed 0) and (b) 60 calls of 1-4 such images. Modes side by side in one run: HF eager,
torch.compile default, vitgraph (defaults: ladder of 2 steps per doubling, padded MLP weights,
Inductor-fused block ops inside the graphs on CUDA; its first pass includes those compiles),
vitgraph-torch-launch (the same with ``graph_launch="torch"``: graphs replayed through
``CUDAGraph.replay()`` instead of device-launch executables), vitgraph-varlen (the same with
flash varlen for full attention too, ``attention="varlen"``: the default sends it to cuDNN when
nvidia-cudnn-frontend is installed), vitgraph-windows-flash (the defaults with the window layers
on flash varlen instead of the short-segment kernel, ``flash_windows``), vitgraph-unfused (the
same without the fused ops, ``adapt(tower, fuse=False)``) and vitgraph-v1
(session 1's configuration: doubling ladder, unpadded MLP, unfused), so the effect of each change
is measured in the same process. Reports p50/p99/total (second pass), first pass, graph memory,
padding ratio. JSON to $OUT (else the working directory).

Usage: python benchmarks/qwen_stream.py [--modes hf-eager,compile-default,vitgraph] [--calls 60]
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


def tower():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel)

    cfg = Qwen2_5_VLVisionConfig(depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420,
                                 out_hidden_size=2048, patch_size=14, spatial_merge_size=2,
                                 window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                                 temporal_patch_size=2, in_channels=3)
    torch.manual_seed(0)
    return Qwen2_5_VisionTransformerPretrainedModel(cfg).cuda().to(torch.bfloat16).eval()


def warm_image(served, side, calls=5):
    """One image of ``side`` x ``side`` patches for :func:`tower` (bf16 pixels on the GPU, the
    grid as a list), served ``calls`` times (its graph captured) and the device synced."""
    pv = torch.randn(side * side, 1176, device="cuda", dtype=torch.bfloat16)
    grid = [[1, side, side]]
    with torch.inference_mode():
        for _ in range(calls):
            served(pv, grid)
    torch.cuda.synchronize()
    return pv, grid


def stream(calls, max_images, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(calls):
        n = 1 if max_images == 1 else rng.randint(1, max_images)
        grids = [[1, rng.randrange(224, 897, 28) // 14, rng.randrange(224, 897, 28) // 14]
                 for _ in range(n)]
        rows = sum(t * h * w for t, h, w in grids)
        out.append((torch.randn(rows, 1176, device="cuda", dtype=torch.bfloat16),
                    torch.tensor(grids, device="cuda", dtype=torch.long)))
    return out


def pct(v, q):
    s = sorted(v)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def flash_windows(served):
    """``served`` with its window layers on flash varlen in every budget: the defaults before
    the short-segment kernel (``adapters/_short_attention.py``), for a side-by-side run. A
    benchmark switch, not an option: it turns the kernel off before the first capture."""
    served.encoder.attention.short = None
    served.encoder.attention.short_off = "benchmark: window layers on flash varlen"
    return served


def run(mode, model, calls):
    from vit_graph_backend import serve

    torch.compiler.reset()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    res = {"mode": mode}
    try:
        if mode == "hf-eager":
            fn = lambda pv, g: model(pv, g).pooler_output  # noqa: E731
        elif mode == "compile-default":
            c = torch.compile(model)
            fn = lambda pv, g: c(pv, g).pooler_output  # noqa: E731
        elif mode == "vitgraph":
            served = serve(model, max_items_per_graph=4)
            fn = served
        elif mode == "vitgraph-epilogue-off":  # MLPs' first half not through fused_linear
            served = serve(model, max_items_per_graph=4, epilogue_fusion="off")
            fn = served
        elif mode == "vitgraph-torch-launch":  # every graph through CUDAGraph.replay()
            served = serve(model, max_items_per_graph=4, graph_launch="torch")
            fn = served
        elif mode == "vitgraph-windows-flash":  # window layers on flash varlen, as before
            served = flash_windows(serve(model, max_items_per_graph=4))
            fn = served
        elif mode == "vitgraph-varlen":  # flash varlen for full attention too
            served = serve(model, max_items_per_graph=4, attention="varlen")
            fn = served
        elif mode == "vitgraph-v1":
            from vit_graph_backend import adapt

            served = serve(adapt(model, align_mlp=False, fuse=False), max_items_per_graph=4,
                           ladder_steps=1)
            fn = served
        elif mode == "vitgraph-unfused":
            from vit_graph_backend import adapt

            served = serve(adapt(model, fuse=False), max_items_per_graph=4)
            fn = served
        else:
            raise ValueError(mode)
        with torch.inference_mode():
            t0 = time.perf_counter()
            firsts = [fn(pv, g).float() for pv, g in calls[:5]]
            for pv, g in calls[5:]:
                fn(pv, g)
            torch.cuda.synchronize()
            res["first_pass_s"] = time.perf_counter() - t0
            lat = []
            t_all = time.perf_counter()
            for pv, g in calls:
                torch.cuda.synchronize()
                t = time.perf_counter()
                fn(pv, g)
                torch.cuda.synchronize()
                lat.append((time.perf_counter() - t) * 1e3)
            res["total_ms"] = (time.perf_counter() - t_all) * 1e3
        res.update(p50_ms=pct(lat, 50), p99_ms=pct(lat, 99), mean_ms=statistics.fmean(lat),
                   peak_memory_mib=torch.cuda.max_memory_allocated() / 2**20)
        res["firsts"] = firsts
        if mode.startswith("vitgraph"):
            res["aligned_mlp_mib"] = served.encoder.aligned_mlp_bytes / 2**20
            res["fusion"] = served.encoder.fusion_state
            rep = served.manager.memory_report()
            st = served.manager.stats.as_dict()
            res.update(graphs=rep["graphs"], budgets=rep["budgets"],
                       graph_memory_mib=rep["total_bytes"] / 2**20,
                       capture_s=rep["capture_seconds"], padding_ratio=st["padding_ratio"],
                       hit_rate=st["hit_rate"], eager_items=st["eager_items"])
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        traceback.print_exc()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes",
                    default="hf-eager,vitgraph-v1,vitgraph-unfused,vitgraph,compile-default")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--workloads", default="single,multi")
    args = ap.parse_args()
    model = tower()
    all_results = {}
    for wl in args.workloads.split(","):
        calls = stream(args.calls, 1 if wl == "single" else 4)
        results, ref = [], None
        for mode in args.modes.split(","):
            r = run(mode, model, calls)
            firsts = r.pop("firsts", None)
            if mode == "hf-eager":
                ref = firsts
            elif firsts and ref:
                r["max_rel_err_vs_eager"] = max(
                    ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()
                    for a, b in zip(firsts, ref))
            results.append(r)
            print(wl, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()},
                  flush=True)
        all_results[wl] = results
    meta = {"benchmark": "qwen2_5_vl_3b_tower_stream", "dtype": "bfloat16", "calls": args.calls,
            "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "results": all_results}
    import transformers
    meta["transformers"] = transformers.__version__
    name = (f"qwen_tower_stream_latency_"
            f"{torch.cuda.get_device_name(0).replace('NVIDIA ', '').split()[0]}_torch"
            f"{torch.__version__.split('+')[0]}.json")
    for folder in [Path(os.environ.get("OUT", "."))]:
        if folder:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(json.dumps(meta, indent=2))
    print(f"\n{'workload':<8}{'mode':<23}{'p50 ms':>9}{'p99 ms':>9}{'total ms':>10}{'first s':>9}"
          f"{'graph MiB':>10}{'graphs':>7}{'pad':>6}{'rel err':>9}")
    for wl, results in all_results.items():
        for r in results:
            if "error" in r:
                print(f"{wl:<8}{r['mode']:<23} FAILED: {r['error']}")
                continue
            print(f"{wl:<8}{r['mode']:<23}{r['p50_ms']:9.2f}{r['p99_ms']:9.2f}{r['total_ms']:10.0f}"
                  f"{r['first_pass_s']:9.1f}{r.get('graph_memory_mib', 0):10.0f}"
                  f"{r.get('graphs', '-'):>7}{r.get('padding_ratio', 0):6.2f}{r.get('max_rel_err_vs_eager', 0):9.3g}")


if __name__ == "__main__":
    main()
