"""What running a packed call's hook, code and weight-copy checks after its graph launch
(``call_checks.py``) saves, measured in one process with the calls of both orders interleaved.

Across processes the host time of one call varies by more than the change (the phase probe,
``packed_host_phases_probe.py``, saw 190 to 410 us to the launch between processes of one tree).
So this probe runs one served tower and alternates, call by call, the default order (checks after
the launch) with the order before it, which it restores by running the same checks before
``_replay`` (a call then finds them done, and runs none after the launch). For each it reports,
median over the calls:

- ``to launch``: from the call's start to its graph's launch (the GPU idle meanwhile, after a
  sync);
- ``call``: the call's host time;
- ``call + sync``: the call and a device sync after it, one request's latency.

Calls are made right after a device sync (as at a request's start) and back to back (the GPU
busy with the previous call). The Qwen2.5-VL-3B-shaped tower, random weights, bf16, defaults,
one image of ``side`` x ``side`` patches a call, the grid as a list.

Usage: python benchmarks/checks_after_launch_probe.py [--sides 16,32,64] [--calls 60]
       [--name NAME]. Text to stdout and to $OUT/NAME.txt when $OUT is set.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

ORDERS = ("checks before launch", "checks after launch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sides", default="16,32,64")
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--name", default="checks_after_launch_probe")
    args = parser.parse_args()
    import torch
    from _bench_out import emit
    from qwen_stream import tower, warm_image

    from vit_graph_backend import runtime, serve

    served = serve(tower())
    manager = served.manager
    marks: dict[str, int] = {}
    state = {"before": False}
    replay, graph_replay = runtime.EncoderCudaGraphManager._replay, None

    def ordered(self, inputs, batch, call):
        if state["before"]:
            self.checks.look(call)  # the order before: a call's checks ahead of its launch
        return replay(self, inputs, batch, call)

    runtime.EncoderCudaGraphManager._replay = ordered
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; one served "
             f"Qwen2.5-VL-3B-shaped tower, bf16; {args.calls} calls per order and condition, the "
             "orders interleaved call by call; us, median",
             f"{'patches':>8} {'condition':<13} {'order':<22}{'to launch':>10}{'call':>9}"
             f"{'call + sync':>13}"]
    for side in (int(s) for s in args.sides.split(",")):
        pv, grid = warm_image(served, side)
        if graph_replay is None:   # every budget's graph is of one class
            graph_type = type(next(iter(manager._graphs.values())).graph)
            graph_replay = graph_type.replay

            def marked(self, *a, **k):
                marks.setdefault("launch", time.perf_counter_ns())
                return graph_replay(self, *a, **k)

            graph_type.replay = marked
        rows: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        with torch.inference_mode():
            for i in range(2 * args.calls):
                order = ORDERS[i % 2]
                state["before"] = order == ORDERS[0]
                for condition in ("after sync", "back to back"):
                    if condition == "after sync":
                        torch.cuda.synchronize()
                    marks.clear()
                    start = time.perf_counter_ns()
                    served(pv, grid)
                    end = time.perf_counter_ns()
                    row = rows[(condition, order)]
                    row["to launch"].append((marks["launch"] - start) / 1e3)
                    row["call"].append((end - start) / 1e3)
                    if condition == "after sync":
                        torch.cuda.synchronize()
                        row["call + sync"].append((time.perf_counter_ns() - start) / 1e3)
        torch.cuda.synchronize()
        for condition in ("after sync", "back to back"):
            for order in ORDERS:
                row = rows[(condition, order)]
                sync = (f"{statistics.median(row['call + sync']):>13.1f}"
                        if row["call + sync"] else f"{'':>13}")
                lines.append(f"{side * side:>8} {condition:<13} {order:<22}"
                             f"{statistics.median(row['to launch']):>10.1f}"
                             f"{statistics.median(row['call']):>9.1f}{sync}")
    state["before"] = False
    emit(lines, args.name)


if __name__ == "__main__":
    main()
