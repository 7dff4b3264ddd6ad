"""Where does the time go? Three small measurements behind the performance work (CUDA only).

1. ``mlp``: the Qwen2.5-VL-3B block MLP (hidden 1280, intermediate 3420, SiLU-gated, with bias) at
   several row counts, as HF runs it (three GEMMs, N=3420) and with the intermediate zero-padded
   to a multiple of 8 (3424) and of 64 (3456), separate and with gate/up fused into one GEMM.
   Each variant is captured in a CUDA graph of 32 MLPs (one tower's worth) and replayed, so launch
   overhead is out of the figure.
2. ``vit``: timm ViT-B/16 bf16 at batch 1, 8, 16, 32: eager, an exact-shape graph replay, and a
   ``torch.compile(backend="vitgraph")`` call (budget = batch, so no padding): the difference
   between the last two is the per-call host overhead of the backend.
3. ``qwen``: one image through ``serve()`` versus the raw replay of the same budget's graph.

Usage: python benchmarks/diagnose.py [mlp,vit,qwen]. Prints a table per section and writes JSON
to benchmarks/results/ (and $OUT when set).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def timed(fn, reps=50, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return times[len(times) // 2]


def table(title, columns, rows):
    print(f"\n{title}")
    print("".join(f"{c:>10}" for c in columns))
    for row in rows:
        print("".join(f"{v:10.3f}" if isinstance(v, float) else f"{v:>10}" for v in row))


def capture(fn, warmup=3):
    """``fn`` run ``warmup`` times on a side stream, then captured: ``(graph, captured output)``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def graphed(fn):
    return capture(fn)[0]


def mlp_section():
    dev, dt, hidden, inter, depth = "cuda", torch.bfloat16, 1280, 3420, 32
    torch.manual_seed(0)
    gate = torch.randn(inter, hidden, device=dev, dtype=dt) * 0.02
    up = torch.randn(inter, hidden, device=dev, dtype=dt) * 0.02
    down = torch.randn(hidden, inter, device=dev, dtype=dt) * 0.02
    bg, bu, bd = (torch.randn(n, device=dev, dtype=dt) * 0.02 for n in (inter, inter, hidden))

    def padded(width):
        p = width - inter
        return (F.pad(gate, (0, 0, 0, p)), F.pad(up, (0, 0, 0, p)), F.pad(down, (0, p)),
                F.pad(bg, (0, p)), F.pad(bu, (0, p)))

    variants = {}
    variants["hf 3420"] = lambda x: F.linear(F.silu(F.linear(x, gate, bg)) * F.linear(x, up, bu),
                                             down, bd)
    for width in (3424, 3456):
        g2, u2, d2, bg2, bu2 = padded(width)
        variants[f"pad {width}"] = (lambda x, g2=g2, u2=u2, d2=d2, bg2=bg2, bu2=bu2:
                                    F.linear(F.silu(F.linear(x, g2, bg2)) * F.linear(x, u2, bu2),
                                             d2, bd))
        gu, bgu = torch.cat([g2, u2]), torch.cat([bg2, bu2])

        def fused(x, gu=gu, bgu=bgu, d2=d2, w=width):
            h = F.linear(x, gu, bgu)
            return F.linear(F.silu(h[:, :w]) * h[:, w:], d2, bd)
        variants[f"fused {width}"] = fused
    rows_list = (256, 1024, 2304, 4096, 8192)
    table = {}
    with torch.inference_mode():
        for rows in rows_list:
            x = torch.randn(rows, hidden, device=dev, dtype=dt)
            ref = variants["hf 3420"](x).float()
            for name, fn in variants.items():
                err = (fn(x).float() - ref).abs().max().item()
                g = graphed(lambda fn=fn: [fn(x) for _ in range(depth)])
                ms = timed(g.replay, reps=20)
                table.setdefault(name, {})[rows] = {"ms_32_blocks": ms, "max_abs_err": err}
                del g
    print(f"\nMLP x32 blocks, graph replay ms (bf16, hidden {hidden})")
    print(f"{'variant':<14}" + "".join(f"{r:>9}" for r in rows_list))
    for name, row in table.items():
        print(f"{name:<14}" + "".join(f"{row[r]['ms_32_blocks']:9.2f}" for r in rows_list))
    return table


def vit_section():
    import timm

    from vit_graph_backend.compile.backend import vitgraph

    torch.manual_seed(0)
    dt = torch.bfloat16
    model = timm.create_model("vit_base_patch16_224", pretrained=False).cuda().to(dt).eval()
    out = {}
    with torch.inference_mode():
        compiled = torch.compile(model, backend="vitgraph",
                                 options={"budgets": [1, 8, 16, 32]})
        for b in (2, 3, 1, 8, 16, 32):  # static, dynamic, batch-1 compiles first
            compiled(torch.randn(b, 3, 224, 224, device="cuda", dtype=dt))
        for b in (1, 8, 16, 32):
            x = torch.randn(b, 3, 224, 224, device="cuda", dtype=dt)
            eager = timed(lambda: model(x))
            g = graphed(lambda: model(x))
            floor = timed(g.replay)
            del g
            call = timed(lambda: compiled(x))
            # host time of one call without waiting for the GPU (what the CPU spends launching)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                compiled(x)
            host = (time.perf_counter() - t) / 20 * 1e3
            torch.cuda.synchronize()
            out[b] = {"eager_ms": eager, "graph_floor_ms": floor, "vitgraph_call_ms": call,
                      "vitgraph_host_ms_per_call_unsynced": host}
    print(vitgraph.report()["stats"])
    table("ViT-B/16 bf16 (ms, p50 of 50)", ["batch", "eager", "floor", "vitgraph", "overhead"],
          [[b, r["eager_ms"], r["graph_floor_ms"], r["vitgraph_call_ms"],
            r["vitgraph_call_ms"] - r["graph_floor_ms"]] for b, r in out.items()])
    return out


def qwen_section():
    sys.path.insert(0, str(Path(__file__).parent))
    from qwen_stream import tower

    from vit_graph_backend import serve

    model = tower()
    served = serve(model, max_items_per_graph=4)
    out = {}
    with torch.inference_mode():
        for side in (224, 448, 672, 896):
            n = side // 14
            grid = torch.tensor([[1, n, n]], device="cuda")
            pv = torch.randn(n * n, 1176, device="cuda", dtype=torch.bfloat16)
            served(pv, grid)
            eager = timed(lambda: model(pv, grid), reps=10)
            call = timed(lambda: served(pv, grid), reps=30)
            tokens = n * n // 4
            budget = min(b for b in served.manager.token_budgets if b >= tokens)
            entry = served.manager.graphs.entries[budget]
            floor = timed(entry.graph.replay, reps=30)
            out[side] = {"tokens": tokens, "budget": budget, "hf_eager_ms": eager,
                         "served_ms": call, "budget_graph_replay_ms": floor}
    table("Qwen2.5-VL-3B tower, one image (ms, p50)",
          ["side", "tokens", "budget", "eager", "served", "replay"],
          [[side, r["tokens"], r["budget"], r["hf_eager_ms"], r["served_ms"],
            r["budget_graph_replay_ms"]] for side, r in out.items()])
    return out


def main():
    sections = (sys.argv[1] if len(sys.argv) > 1 else "mlp,vit,qwen").split(",")
    funcs = {"mlp": mlp_section, "vit": vit_section, "qwen": qwen_section}
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for name in sections:
        result[name] = funcs[name]()
        torch.compiler.reset()
        torch.cuda.empty_cache()
    tag = torch.cuda.get_device_name(0).replace(" ", "_")
    fname = f"diagnose_{'_'.join(sections)}_{tag}_torch{torch.__version__.split('+')[0]}.json"
    for folder in [Path("benchmarks/results"), Path(os.environ["OUT"]) if os.environ.get("OUT") else None]:
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / fname).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
