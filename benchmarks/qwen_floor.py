"""Where the GPU time of one Qwen2.5-VL-3B tower graph goes, and what each adapter change buys.

Three sections, one process, one device (CUDA only):

1. ``kernels``: ``torch.profiler`` over one served call per image size with the default adapter
   (copies in, graph replay, output clone): device time by kernel family and the top kernels.
2. ``variants``: raw replay time of each budget's graph (no routing, no copies) for the adapter
   through its public ``fuse`` setting, captured and timed in this one process: ``unfused``
   (``fuse=False``: the plain ops) and ``fused`` (the default: Inductor-fused rotary,
   residual-add + norm and SiLU gate, compile time included in its capture seconds). The served
   call time of the default is measured beside its replay (the difference is routing and copies).
   The committed ``qwen_floor_*.json`` also holds two earlier variants (HF's Conv3d patch
   embedding and HF-order RMSNorm), measured when those were the adapter's code; they are not
   re-run, since reproducing them meant patching the adapter's private functions.
3. ``inductor``: the whole tower through ``inner_compiler="inductor"`` (one Inductor compile with
   symbolic rows, captured per budget): compile + capture seconds and replay times.

Usage: python benchmarks/qwen_floor.py [variants,kernels,inductor]. JSON to benchmarks/results/
(and $OUT when set); a table per section on stdout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from diagnose import timed  # noqa: E402
from qwen_stream import tower  # noqa: E402

from vit_graph_backend import adapt, serve  # noqa: E402

SIDES = (16, 32, 64)  # patches per side: 256 / 1024 / 4096 patches = 64 / 256 / 1024 tokens
BUDGETS = [s * s // 4 for s in SIDES]


# name -> the adapter's fuse setting
VARIANTS = {"unfused": False, "fused": None}


def image(side):
    grid = torch.tensor([[1, side, side]], device="cuda")
    return torch.randn(side * side, 1176, device="cuda", dtype=torch.bfloat16), grid


def family(name):
    n = name.lower()
    for key, words in (("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
                       ("attention", ("flash", "fmha", "attention")),
                       ("conv", ("conv", "cudnn", "implicit")),
                       ("norm", ("norm",)),
                       ("copy/cast", ("copy", "memcpy", "memset", "cat")),
                       ("reduce", ("reduce",)),
                       ("index", ("index", "gather", "scatter"))):
        if any(w in n for w in words):
            return key
    return "elementwise/other"


def kernels_section(model):
    out = {}
    with torch.inference_mode():
        served = serve(model, budgets=BUDGETS, max_items_per_graph=4)
        for side in SIDES:
            pv, grid = image(side)
            for _ in range(3):
                served(pv, grid)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                served(pv, grid)
                torch.cuda.synchronize()
            by_kernel, by_family, count = defaultdict(float), defaultdict(float), 0
            for e in prof.events():
                if e.device_type != torch.autograd.DeviceType.CUDA:
                    continue
                us = e.time_range.elapsed_us()
                by_kernel[e.name] += us
                by_family[family(e.name)] += us
                count += 1
            total = sum(by_family.values())
            top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:12]
            out[side * side] = {"kernels": count, "device_ms": total / 1e3,
                                "by_family_ms": {k: v / 1e3 for k, v in by_family.items()},
                                "top_ms": [[k[:90], v / 1e3] for k, v in top]}
            print(f"\n[kernels] {side * side} patches: {count} kernels, {total / 1e3:.2f} ms device")
            for k, v in sorted(by_family.items(), key=lambda kv: -kv[1]):
                print(f"  {k:<20}{v / 1e3:8.2f} ms")
            for k, v in top:
                print(f"    {v / 1e3:7.2f} ms  {k[:100]}")
    return out


def replay_times(served):
    return {b: timed(served.manager.graphs.entries[b].graph.replay, reps=30) for b in BUDGETS}


def variants_section(model):
    out = {}
    for name, fuse in VARIANTS.items():
        with torch.inference_mode():
            served = serve(adapt(model, fuse=fuse), budgets=BUDGETS, max_items_per_graph=4)
            t = time.perf_counter()
            served.manager.capture()
            capture_s = time.perf_counter() - t
            row = {"capture_s": capture_s, "replay_ms": replay_times(served)}
            if name == "fused":
                row["fusion"] = served.encoder.fusion_state
                row["served_ms"] = {}
                for side, budget in zip(SIDES, BUDGETS):
                    pv, grid = image(side)
                    row["served_ms"][budget] = timed(lambda: served(pv, grid), reps=30)
            out[name] = row
            served.manager.clear()
            del served
            torch.cuda.empty_cache()
    print("\n[variants] graph replay ms (p50 of 30) by budget (tokens)")
    print(f"{'variant':<14}" + "".join(f"{b:>9}" for b in BUDGETS) + f"{'capture s':>11}")
    for name, row in out.items():
        print(f"{name:<14}" + "".join(f"{row['replay_ms'][b]:9.2f}" for b in BUDGETS)
              + f"{row['capture_s']:11.2f}")
        if "served_ms" in row:
            print(f"{'  served call':<14}" + "".join(f"{row['served_ms'][b]:9.2f}" for b in BUDGETS))
    return out


def inductor_section(model):
    with torch.inference_mode():
        served = serve(model, budgets=BUDGETS, max_items_per_graph=4, inner_compiler="inductor")
        t = time.perf_counter()
        served.manager.capture()
        compile_s = time.perf_counter() - t
        replay = replay_times(served)
        pv, grid = image(SIDES[-1])
        reference = serve(model, budgets=BUDGETS, max_items_per_graph=4)
        out, ref = served(pv, grid).float(), reference(pv, grid).float()
        err = ((out - ref).abs().max() / ref.abs().max().clamp(min=1)).item()
    print(f"\n[inductor] whole tower through inner_compiler='inductor' (one compile, rows "
          f"symbolic): compile+capture of {len(BUDGETS)} budgets {compile_s:.1f} s; replay ms "
          + ", ".join(f"{b}: {replay[b]:.2f}" for b in BUDGETS)
          + f"; max relative diff vs the default graphs {err:.3g}")
    return {"budgets": BUDGETS, "compile_capture_s": compile_s, "replay_ms": replay,
            "max_rel_diff_vs_default": err}


def main():
    sections = (sys.argv[1] if len(sys.argv) > 1 else "variants,kernels,inductor").split(",")
    funcs = {"kernels": kernels_section, "variants": variants_section,
             "inductor": inductor_section}
    model = tower()
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "model": "Qwen2.5-VL-3B-shaped vision tower, random weights, bf16"}
    tag = torch.cuda.get_device_name(0).replace(" ", "_")
    fname = f"qwen_floor_{tag}_torch{torch.__version__.split('+')[0]}.json"
    for name in sections:
        try:
            result[name] = funcs[name](model)
        except Exception as exc:  # keep the other sections' figures
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            print(f"[{name}] FAILED: {result[name]['error']}")
        torch.compiler.reset()
        torch.cuda.empty_cache()
        for folder in [Path("benchmarks/results"),
                       Path(os.environ["OUT"]) if os.environ.get("OUT") else None]:
            if folder is not None:
                folder.mkdir(parents=True, exist_ok=True)
                (folder / fname).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
