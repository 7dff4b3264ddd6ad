"""Where one packed call's host time goes, phase by phase, for a call issued right after a device
sync (the GPU idle, as at the start of a request) against calls issued back to back.

``benchmarks/results/packed_call_host_time_after_sync_gpu_idle_vs_busy_*`` found one 4,096-patch
call 3 to 5x slower on the host after a sync than in a back-to-back loop, every function alike.
This probe times the call's phases (inclusive wall time of each wrapped function, so nested
phases are counted in their parents too) in both conditions, to say which phases a cut would
pay in, and how much a cold call slows each. Two rows are not phases: ``to launch``, from the
call's start to its graph's launch (the GPU idle meanwhile after a sync), and ``call + sync``,
the call and a device sync after it (one request's latency; the GPU's time included).

The Qwen2.5-VL-3B-shaped tower (random weights, bf16, defaults), one image of ``--side`` x
``--side`` patches, the grid as a list. ``--source`` puts another tree's ``src`` first on the
path (``baseline/src`` for a before/after run in one call).

Usage: python benchmarks/packed_host_phases_probe.py [--side 64] [--calls 30] [--source DIR]
       [--name NAME]. Text to stdout and to $OUT/NAME.txt when $OUT is set.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def _wrap(owner, name, label, times):
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args, **kwargs):
        start = time.perf_counter_ns()
        if label == "graph.replay" and "to launch" not in times:
            times["to launch"] = start - times["start"]
        try:
            return original(*args, **kwargs)
        finally:
            times[label] += time.perf_counter_ns() - start

    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--side", type=int, default=64)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--source", default=None)
    parser.add_argument("--name", default="packed_host_phases_probe")
    args = parser.parse_args()
    if args.source:
        sys.path.insert(0, args.source)
    import torch
    from _bench_out import emit
    from qwen_stream import tower, warm_image

    import vit_graph_backend as vg
    from vit_graph_backend import serve, weight_watch
    from vit_graph_backend.adapters import serve as packed
    from vit_graph_backend.runtime import manager as runtime
    try:
        from vit_graph_backend import call_checks
    except ImportError:  # a tree from before the checks after the launch
        call_checks = None
    from vit_graph_backend.adapters import kernel_choices as _qwen_kernels
    from vit_graph_backend.adapters import packing as _qwen_packing
    from vit_graph_backend.adapters import qwen as qwen_vl

    served = serve(tower())
    side = args.side
    pv, grid = warm_image(served, side)

    times: dict[str, int] = defaultdict(int)
    manager = served.manager
    entry = next(iter(manager._graphs.values()))
    adapter = type(manager.model)
    phases = [
        (packed.PackedGraphEncoder, "_grid_of", "grid_of"),
        (runtime.EncoderCudaGraphManager, "run", "manager.run"),
        (weight_watch.WeightWatch, "moved", "watch.moved"),
        (weight_watch.WeightWatch, "hooked", "watch.hooked"),
        (getattr(call_checks, "CallChecks", None), "look", "checks after launch"),
        (type(manager.served), "plan", "served.plan"),
        (adapter, "get_encoder_cudagraph_item_specs", "item_specs"),
        (adapter, "prepare_encoder_cudagraph_replay_buffers", "replay_buffers"),
        (_qwen_packing.QwenPacker if hasattr(_qwen_packing, "QwenPacker") else
         type(manager.model.packer), "replay_values", "  packer.replay_values"),
        (_qwen_kernels.KernelChoices, "sync", "  kernels.sync"),
        (_qwen_packing, "_pixels", "    pixel rows"),
        (runtime, "write_inputs", "write_inputs"),
        (type(entry.graph), "replay", "graph.replay"),
        (runtime, "map_output", "output clone"),
        (runtime, "split_rows", "split_rows"),
        (packed, "_concat", "concat"),
    ]
    for owner, name, label in phases:
        if owner is not None and hasattr(owner, name):
            _wrap(owner, name, label, times)
    del qwen_vl, vg

    def one(sync: bool) -> dict[str, float]:
        if sync:
            torch.cuda.synchronize()
        times.clear()
        start = times["start"] = time.perf_counter_ns()
        served(pv, grid)
        total = time.perf_counter_ns() - start
        if sync:
            torch.cuda.synchronize()
        done = time.perf_counter_ns() - start
        del times["start"]
        out = {label: ns / 1e3 for label, ns in times.items()}
        out["call"] = total / 1e3
        if sync:
            out["call + sync"] = done / 1e3
        return out

    rows: dict[str, dict[str, list[float]]] = {"after sync": defaultdict(list),
                                               "back to back": defaultdict(list)}
    with torch.inference_mode():
        for _ in range(args.calls):
            for label, us in one(True).items():
                rows["after sync"][label].append(us)
        torch.cuda.synchronize()
        for _ in range(3):
            one(False)
        for _ in range(args.calls):
            for label, us in one(False).items():
                rows["back to back"][label].append(us)
        torch.cuda.synchronize()
    order = ["call + sync", "call", "to launch", *[label for _, _, label in phases]]
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; source "
             f"{Path(vg_path()).parent}; one image of {side * side} patches a call, "
             f"{args.calls} calls each; us, median (inclusive of nested phases)",
             f"{'phase':<26}{'after sync':>12}{'back to back':>14}{'ratio':>8}"]
    for label in order:
        cold, warm = rows["after sync"].get(label), rows["back to back"].get(label)
        if not cold:
            continue
        c = statistics.median(cold)
        if not warm:  # after a sync only (the call's latency)
            lines.append(f"{label:<26}{c:>12.1f}{'':>14}{'':>8}")
            continue
        w = statistics.median(warm)
        lines.append(f"{label:<26}{c:>12.1f}{w:>14.1f}{c / max(w, 1e-9):>8.2f}")
    emit(lines, args.name)


def vg_path() -> str:
    import vit_graph_backend
    return vit_graph_backend.__file__


if __name__ == "__main__":
    main()
