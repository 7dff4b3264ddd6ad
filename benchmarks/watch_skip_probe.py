"""What leaving the MLP weights out of the check before each packed call saves, in one process.

The manager's weight watch checks, before a call's graph launches, that every tensor its graphs
read still lives where they read it (``weight_watch.py``). The Qwen adapters' graphs read the MLP
weights only through padded copies, which the adapter follows itself after the launch
(``adapters/_aligned_mlp.py``), so the watch leaves those 160 of the 3B tower's 392 tensors out
(``WeightWatch.skip``, ``call_checks.CallChecks.captured``). Across processes the host time of one
call varies by more than the change (``packed_call_host_time_*``), so this probe runs one served
tower and alternates, call by call, the watch as the package sets it (``skip``) with the watch
checking every tensor (``check all``). For each, the medians of ``_interleaved_calls.py``'s
columns: the time to the graph's launch (the GPU idle meanwhile, after a sync), the call's host
time, and the call with a device sync after it (one request's latency), for calls right after a
sync and back to back. The Qwen2.5-VL-3B-shaped tower, random weights, bf16, defaults, one image of
``side`` x ``side`` patches a call, the grid as a list.

Usage: python benchmarks/watch_skip_probe.py [--sides 32,64] [--calls 60] [--name NAME].
Text to stdout and to $OUT/NAME.txt when $OUT is set.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

MODES = ("check all", "skip")


def main() -> None:
    from _interleaved_calls import arguments, header, interleaved, table_lines

    args = arguments(__doc__, "32,64", "watch_skip_probe")
    import torch
    from _bench_out import emit
    from qwen_stream import tower, warm_image

    from vit_graph_backend import serve

    served = serve(tower())
    checks = served.manager.checks
    lines = []
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

        def set_mode(mode: str) -> None:
            checks.watch._checked, checks.watch._checked_then = states[mode]

        try:
            rows = interleaved(served, pv, grid, MODES, set_mode, args.calls)
        finally:
            checks.watch.skip(skipped)
        lines += table_lines(rows, side * side, MODES, 10)
    watch = checks.watch
    emit([f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; one served "
          f"Qwen2.5-VL-3B-shaped tower, bf16; tensors watched {len(watch._slots[1])}, checked "
          f"before the launch with skip {len(watch._checked[1])}; {args.calls} calls per mode "
          "and condition, the modes interleaved call by call; us, median",
          header("mode", 10), *lines], args.name)


if __name__ == "__main__":
    main()
