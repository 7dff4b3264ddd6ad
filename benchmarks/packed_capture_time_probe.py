"""Where the capture time of a packed tower goes: each attention setting's ``capture()`` of the
Qwen2.5-VL-3B-shaped tower's default ladder, in one process, then ``cProfile`` of one capture.

The capture-time choices (``adapters/_attention_choice.py``) time kernels before each budget is
captured: the window kernel against flash varlen, and with Triton the segment kernel against
cuDNN (or flash varlen) on each budget's full-attention layouts. This probe times ``capture()``
for ``attention="cudnn"`` (no segment-kernel race), for the defaults and for ``warmup_iters=2``
(the defaults with a second warm-up run per budget), twice each in the
order given (the first capture in the process also pays the one-time costs: Triton's compiles
and cuDNN's plans, Triton's disk cache permitting), and prints the top functions of the last
capture by cumulative time.

Usage: python benchmarks/packed_capture_time_probe.py [--order cudnn,default,default]
[--profile 30]. Text to stdout and $OUT/packed_capture_time_probe.txt when $OUT is set.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _bench_out import emit  # noqa: E402
from qwen_stream import tower  # noqa: E402

from vit_graph_backend import serve  # noqa: E402

MODES = {"default": {}, "cudnn": {"attention": "cudnn"}, "varlen": {"attention": "varlen"},
         "warmup2": {"warmup_iters": 2}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--order", default="cudnn,default,default",
                        help=f"attention settings to capture, in turn: {', '.join(MODES)}")
    parser.add_argument("--profile", type=int, default=30, metavar="N",
                        help="profile the last capture and print its top N functions (0: none)")
    args = parser.parse_args()
    order = args.order.split(",")
    unknown = [m for m in order if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    model = tower()
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
             "Qwen2.5-VL-3B-shaped tower, bf16, default ladder",
             f"{'#':>2}  {'mode':<8}{'graphs':>7}{'capture s':>11}  full-attention timings"]
    print("\n".join(lines), flush=True)
    for i, mode in enumerate(order):
        served = serve(model, **MODES[mode])
        profiler = cProfile.Profile() if args.profile and i == len(order) - 1 else None
        torch.cuda.synchronize()
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        served.manager.capture()
        torch.cuda.synchronize()
        if profiler is not None:
            profiler.disable()
        seconds = time.perf_counter() - start
        full = served.encoder.attention_state["full"]
        lines.append(f"{i:>2}  {mode:<8}{served.manager.num_graphs:>7}{seconds:>11.2f}  "
                     f"{full.get('timings_ms') or '-'}")
        print(lines[-1], flush=True)
        if profiler is not None:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(
                args.profile)
            body = text.getvalue().splitlines()
            start_at = next((j for j, row in enumerate(body) if "ncalls" in row), 0)
            lines += [f"cProfile of capture {i} ({mode}), by cumulative time:"]
            lines += [row[:170] for row in body[start_at:] if row.strip()]
            print("\n".join(lines[-args.profile - 2:]), flush=True)
        served.manager.clear()
        del served
    emit(lines, "packed_capture_time_probe", echo=False)


if __name__ == "__main__":
    main()
