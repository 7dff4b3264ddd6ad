"""What running a packed call's hook, code and weight-copy checks after its graph launch
(``call_checks.py``) saves, measured in one process with the calls of both orders interleaved.

Across processes the host time of one call varies by more than the change (the phase probe,
``packed_host_phases_probe.py``, saw 190 to 410 us to the launch between processes of one tree). So
this probe runs one served tower and alternates, call by call, the default order (checks after the
launch) with the order before it, which it restores by running the same checks before ``_replay``
(a call then finds them done, and runs none after the launch). For each, the medians of
``_interleaved_calls.py``'s columns: the time to the graph's launch (the GPU idle meanwhile, after
a sync), the call's host time, and the call with a device sync after it (one request's latency),
for calls right after a sync and back to back. The Qwen2.5-VL-3B-shaped tower, random weights,
bf16, defaults, one image of ``side`` x ``side`` patches a call, the grid as a list.

Usage: python benchmarks/checks_after_launch_probe.py [--sides 16,32,64] [--calls 60]
       [--name NAME]. Text to stdout and to $OUT/NAME.txt when $OUT is set.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

ORDERS = ("checks before launch", "checks after launch")


def main() -> None:
    from _interleaved_calls import arguments, header, interleaved, table_lines

    args = arguments(__doc__, "16,32,64", "checks_after_launch_probe")
    import torch
    from _bench_out import emit
    from qwen_stream import tower, warm_image

    from vit_graph_backend import serve
    from vit_graph_backend.runtime import manager as runtime

    served = serve(tower())
    state = {"before": False}
    replay = runtime.EncoderCudaGraphManager._replay

    def ordered(self, inputs, batch, call):
        if state["before"]:
            self.checks.look(call)  # the order before: a call's checks ahead of its launch
        return replay(self, inputs, batch, call)

    def set_order(order: str) -> None:
        state["before"] = order == ORDERS[0]

    runtime.EncoderCudaGraphManager._replay = ordered
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; one served "
             f"Qwen2.5-VL-3B-shaped tower, bf16; {args.calls} calls per order and condition, the "
             "orders interleaved call by call; us, median", header("order", 22)]
    try:
        for side in (int(s) for s in args.sides.split(",")):
            pv, grid = warm_image(served, side)
            rows = interleaved(served, pv, grid, ORDERS, set_order, args.calls)
            lines += table_lines(rows, side * side, ORDERS, 22)
    finally:
        runtime.EncoderCudaGraphManager._replay = replay
    emit(lines, args.name)


if __name__ == "__main__":
    main()
