"""Two source trees of the package side by side in one process, call by call: is a change to the
package as fast as what it replaces?

Across processes a call's time varies by more than most changes to it, so the baseline tree
(``--baseline``: a folder holding ``vit_graph_backend/``) is imported under another name
(``vit_graph_backend_base``; the package imports itself relatively) beside the installed one, both
serve the same model, and their calls alternate (the order swapped every round). Workloads
(random weights, bf16, the models of ``vitgraph bench``'s registry):

- ``clip``: CLIP ViT-L/14-336 through ``torch.compile`` at 8, 24 and 48 images a call: median ms;
- ``qwen``: the Qwen2.5-VL-3B-shaped tower through ``serve`` on one image of 1,024, 4,096 and
  16,384 patches: median ms;
- ``qwen3``: the Qwen3-VL-8B-shaped tower through ``serve`` on a stream of single images (the
  bench's ``uniform-batch`` stream, one image a call): median and total ms;
- ``vit``: ``vitgraph bench``'s default stream (timm ViT-B/16, batch sizes 1..32) through
  ``torch.compile``: median and total ms;
- ``host``: the Qwen2.5 tower's host time per call, one 1,024-patch image a call, issued back to
  back: median us.

Every timed call is also checked against the other tree's output for the same input (largest
difference printed). Usage: python benchmarks/ab_trees.py --baseline PATH [--workloads
clip,qwen,qwen3,vit,host] [--rounds 30]. A table to stdout and ``$OUT/ab_trees_<workload>.txt``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import vit_graph_backend

NAMES = ("baseline", "this tree")


def baseline_package(source: str):
    """The tree at ``source`` imported as ``vit_graph_backend_base``."""
    folder = Path(source) / "vit_graph_backend"
    if not (folder / "__init__.py").is_file():
        raise SystemExit(f"--baseline {source!r} holds no vit_graph_backend package")
    copy = Path(tempfile.mkdtemp()) / "vit_graph_backend_base"
    shutil.copytree(folder, copy)
    for path in copy.rglob("*.py"):  # a tree may name itself in strings (registry, lazy imports)
        text = path.read_text()
        for quoted in ('"vit_graph_backend.', '"vit_graph_backend"'):
            text = text.replace(quoted, quoted.replace("backend", "backend_base"))
        path.write_text(text)
    sys.path.insert(0, str(copy.parent))
    return importlib.import_module("vit_graph_backend_base")


def backend_of(package):
    """A tree's ``vitgraph`` backend object (its module moved with the sub-packages)."""
    for name in ("compile.backend", "backend"):
        try:
            return importlib.import_module(f"{package.__name__}.{name}").vitgraph
        except ModuleNotFoundError:
            continue
    raise SystemExit(f"{package.__name__} has no vitgraph backend")


def timed(fn, args) -> tuple[float, torch.Tensor]:
    """One call's GPU-side time (ms, events around it, synced) and its first output tensor."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    out = fn(*args)
    end.record()
    end.synchronize()
    first = out if isinstance(out, torch.Tensor) else out[0]
    return start.elapsed_time(end), first


def interleave(fns, calls, rounds: int, warm: int = 2):
    """Per tree, per call index: the times of ``rounds`` rounds (after ``warm``), the trees'
    order swapped every round; and the largest difference between the trees' outputs."""
    times = {name: [[] for _ in calls] for name in NAMES}
    worst = 0.0
    with torch.inference_mode():
        for r in range(warm + rounds):
            order = NAMES if r % 2 == 0 else NAMES[::-1]
            for i, args in enumerate(calls):
                outs = {}
                for name in order:
                    ms, outs[name] = timed(fns[name], args)
                    if r >= warm:
                        times[name][i].append(ms)
                diff = (outs[NAMES[0]].float() - outs[NAMES[1]].float()).abs().max().item()
                worst = max(worst, diff)
    return times, worst


def compiled(base, model):
    return {NAMES[0]: torch.compile(model, backend=backend_of(base)),
            NAMES[1]: torch.compile(model, backend=backend_of(vit_graph_backend))}


def served(base, model):
    return {NAMES[0]: base.serve(model), NAMES[1]: vit_graph_backend.serve(model)}


def build(name: str, dynamic: bool = False):
    from vit_graph_backend.bench.models import MODELS, build_model

    return build_model(MODELS[name], device="cuda", dtype=torch.bfloat16, dynamic_size=dynamic)


def packed_call(side_h: int, side_w: int, dim: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pixels = torch.randn(side_h * side_w, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    return pixels, [[1, side_h, side_w]]


def stream_calls(built, workload: str, calls: int):
    from vit_graph_backend.bench.workloads import make_stream

    entry = built.entry
    modality = "image"
    stream = make_stream(workload, modality, entry.space, calls=calls, seed=0,
                         max_batch=1 if entry.packed else 32)
    generator = torch.Generator().manual_seed(0)
    return [built.inputs(call, generator) for call in stream]


def row(label: str, times: dict, index) -> str:
    med = {n: statistics.median(times[n][index]) for n in NAMES}
    return (f"{label:<28}{med[NAMES[0]]:>12.3f}{med[NAMES[1]]:>12.3f}"
            f"{med[NAMES[1]] / med[NAMES[0]]:>9.3f}")


def workload_clip(base, rounds):
    built = build("clip-l14-336")
    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = (8, 24, 48)
    calls = [(torch.randn(b, 3, 336, 336, device="cuda", dtype=torch.bfloat16, generator=gen),)
             for b in sizes]
    times, worst = interleave(compiled(base, built.module), calls, rounds)
    return [row(f"{b} images (ms)", times, i) for i, b in enumerate(sizes)], worst


def workload_qwen(base, rounds):
    built = build("qwen2.5-vl")
    sides = ((32, 32), (64, 64), (128, 128))
    calls = [packed_call(h, w, 1176, i) for i, (h, w) in enumerate(sides)]
    times, worst = interleave(served(base, built.module), calls, rounds)
    return [row(f"{h * w} patches (ms)", times, i) for i, (h, w) in enumerate(sides)], worst


def _stream_rows(times) -> list[str]:
    per = {n: [statistics.median(t) for t in times[n]] for n in NAMES}
    total = {n: sum(per[n]) for n in NAMES}
    p50 = {n: statistics.median(per[n]) for n in NAMES}
    return [f"{'p50 per call (ms)':<28}{p50[NAMES[0]]:>12.3f}{p50[NAMES[1]]:>12.3f}"
            f"{p50[NAMES[1]] / p50[NAMES[0]]:>9.3f}",
            f"{'stream total (ms)':<28}{total[NAMES[0]]:>12.3f}{total[NAMES[1]]:>12.3f}"
            f"{total[NAMES[1]] / total[NAMES[0]]:>9.3f}"]


def workload_qwen3(base, rounds):
    built = build("qwen3-vl-8b")
    calls = stream_calls(built, "uniform-batch", 24)
    times, worst = interleave(served(base, built.module), calls, max(3, rounds // 6))
    return _stream_rows(times), worst


def workload_vit(base, rounds):
    built = build("vit-b16")
    calls = stream_calls(built, "uniform-batch", 120)
    times, worst = interleave(compiled(base, built.module), calls, max(3, rounds // 6))
    return _stream_rows(times), worst


def workload_host(base, rounds):
    built = build("qwen2.5-vl")
    fns = served(base, built.module)
    pixels, grid = packed_call(32, 32, 1176, 0)
    host = {n: [] for n in NAMES}
    with torch.inference_mode():
        for _ in range(4):
            for name in NAMES:
                fns[name](pixels, grid)
        torch.cuda.synchronize()
        for r in range(rounds * 6):
            name = NAMES[r % 2]
            start = time.perf_counter_ns()
            fns[name](pixels, grid)
            host[name].append((time.perf_counter_ns() - start) / 1e3)
        torch.cuda.synchronize()
    med = {n: statistics.median(host[n]) for n in NAMES}
    line = (f"{'host per call (us)':<28}{med[NAMES[0]]:>12.1f}{med[NAMES[1]]:>12.1f}"
            f"{med[NAMES[1]] / med[NAMES[0]]:>9.3f}")
    return [line], 0.0


WORKLOADS = {"clip": workload_clip, "qwen": workload_qwen, "qwen3": workload_qwen3,
             "vit": workload_vit, "host": workload_host}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True,
                        help="a folder holding the other tree's vit_graph_backend/")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    base = baseline_package(args.baseline)
    head = (f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}; baseline "
            f"{Path(base.__file__).parent}, this tree {Path(vit_graph_backend.__file__).parent}; "
            "calls interleaved, medians")
    print(head, flush=True)
    for name in args.workloads.split(","):
        torch.compiler.reset()
        lines, worst = WORKLOADS[name](base, args.rounds)
        text = [head, f"## {name}: largest difference between the trees' outputs {worst:.3g}",
                f"{'':<28}{'baseline':>12}{'this tree':>12}{'ratio':>9}", *lines]
        print("\n".join(text[1:]), flush=True)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], f"ab_trees_{name}.txt").write_text("\n".join(text) + "\n")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
