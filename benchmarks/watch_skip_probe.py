"""What leaving the MLP weights out of the check before each packed call saves, in one process.

The manager's weight watch checks, before a call's graph launches, that every tensor its graphs
read still lives where they read it (``weight_watch.py``). The Qwen adapters' graphs read the
MLP weights only through padded copies, which the adapter follows itself after the launch
(``adapters/_aligned_mlp.py``), so the watch leaves those 160 of the 3B tower's 392 tensors out
(``WeightWatch.skip``, ``call_checks.CallChecks.captured``). Across processes the host time of
one call varies by more than the change (``packed_call_host_time_*``), so this probe runs one
served tower and alternates, call by call, the watch as the package sets it (``skip``) with
the watch checking every tensor (``check all``). For each, median over the calls:

- ``to launch``: from the call's start to its graph's launch (the GPU idle meanwhile, after a
  sync);
- ``call``: the call's host time;
- ``call + sync``: the call and a device sync after it, one request's latency.

Calls are made right after a device sync (as at a request's start) and back to back (the GPU
busy with the previous call). The Qwen2.5-VL-3B-shaped tower, random weights, bf16, defaults,
one image of ``side`` x ``side`` patches a call, the grid as a list.

Usage: python benchmarks/watch_skip_probe.py [--sides 32,64] [--calls 60] [--name NAME].
Text to stdout and to $OUT/NAME.txt when $OUT is set.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

MODES = ("check all", "skip")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sides", default="32,64")
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--name", default="watch_skip_probe")
    args = parser.parse_args()
    import torch
    from _bench_out import emit
    from qwen_stream import tower, warm_image

    from vit_graph_backend import serve

    served = serve(tower())
    checks = served.manager.checks
    launch: dict[str, int] = {}
    rows: dict[tuple, list[float]] = defaultdict(list)
    for side in map(int, args.sides.split(",")):
        pv, grid = warm_image(served, side)
        skipped = checks._skipped
        assert skipped, "no weight left to copies: nothing to compare"
        # the slots each mode checks and their first addresses, swapped in per call (skip()
        # itself reads the module tree again: a walk per call that is not the change)
        states = {}
        for mode in MODES:
            checks.watch.skip(skipped if mode == "skip" else ())
            states[mode] = (checks.watch._checked, checks.watch._checked_then)
        graph_type = type(next(iter(served.manager.graphs.entries.values())).graph)
        replay = graph_type.replay

        def timed_replay(self, _replay=replay):
            launch.setdefault("at", time.perf_counter_ns())
            return _replay(self)

        graph_type.replay = timed_replay
        try:
            with torch.inference_mode():
                for sync in (True, False):
                    condition = "after sync" if sync else "back to back"
                    for i in range(2 * args.calls + 4):
                        mode = MODES[i % 2]
                        checks.watch._checked, checks.watch._checked_then = states[mode]
                        if sync:
                            torch.cuda.synchronize()
                        launch.clear()
                        start = time.perf_counter_ns()
                        served(pv, grid)
                        end = time.perf_counter_ns()
                        if sync:
                            torch.cuda.synchronize()
                        if i < 4:  # warm both modes first
                            continue
                        key = (side * side, condition, mode)
                        rows[key + ("to launch",)].append((launch["at"] - start) / 1e3)
                        rows[key + ("call",)].append((end - start) / 1e3)
                        if sync:
                            rows[key + ("call + sync",)].append(
                                (time.perf_counter_ns() - start) / 1e3)
                    torch.cuda.synchronize()
        finally:
            graph_type.replay = replay
            checks.watch.skip(skipped)
    watch = checks.watch
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; one served "
             f"Qwen2.5-VL-3B-shaped tower, bf16; tensors watched {len(watch._slots[1])}, "
             f"checked before the launch with skip {len(watch._checked[1])}; {args.calls} calls "
             "per mode and condition, the modes interleaved call by call; us, median",
             f"{'patches':>8} {'condition':<13} {'mode':<10}{'to launch':>11}{'call':>9}"
             f"{'call + sync':>13}"]
    for key in sorted({k[:3] for k in rows}, key=lambda k: (k[0], k[1], MODES.index(k[2]))):
        cells = [rows.get(key + (what,)) for what in ("to launch", "call", "call + sync")]
        lines.append(f"{key[0]:>8} {key[1]:<13} {key[2]:<10}" + "".join(
            f"{statistics.median(c):>{w}.1f}" if c else f"{'':>{w}}"
            for c, w in zip(cells, (11, 9, 13))))
    emit(lines, args.name)


if __name__ == "__main__":
    main()
