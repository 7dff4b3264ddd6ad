"""Host time of one packed call by image size, and where it goes for a large image.

The Qwen2.5-VL-3B-shaped tower (random weights, bf16) served with the defaults, one square image
per call (16 / 32 / 64 / 128 patches a side, the grid given as a list, as a processor's rows), the
same image again and again: the call's host time (call to return, the GPU idle at its start;
median of 10) and its wall time between device syncs. Then ``cProfile`` of 20 calls at
``--profile-side`` (each after a device sync): the top host functions by own time and by
cumulative time, in microseconds per call (``packed_host_overhead.profile_table``). A host time
that grows with the image's rows, when the image and its metadata are the same every call, is
work the GPU waits for before each call.

Usage: python benchmarks/packed_host_by_image_size.py [--profile-side 64]. Text to stdout and
to $OUT/packed_host_by_image_size.txt when $OUT is set.
"""

from __future__ import annotations

import argparse
import cProfile
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _bench_out import emit  # noqa: E402
from packed_host_overhead import profile_table  # noqa: E402
from qwen_stream import tower  # noqa: E402

from vit_graph_backend import serve  # noqa: E402
from vit_graph_backend.bench.timing import CallTimer  # noqa: E402

SIDES = (16, 32, 64, 128)


def host_ms(fn, reps: int = 10) -> float:
    timer = CallTimer("cuda")
    return statistics.median(timer.host(fn)[1] * 1e3 for _ in range(reps))


def profiled(fn, calls: int = 20, top: int = 24) -> list[str]:
    """``packed_host_overhead.profile_table`` of ``calls`` calls, each after a device sync."""
    prof = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        prof.enable()
        fn()
        prof.disable()
    torch.cuda.synchronize()
    return profile_table(prof, calls, top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile-side", type=int, default=64)
    args = parser.parse_args()
    served = serve(tower())
    timer = CallTimer("cuda")
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; Qwen2.5-VL-3B-"
             "shaped tower, defaults, one image per call, the grid as a list",
             f"{'side':>6} {'patches':>8} {'host ms':>8} {'wall ms':>8}"]
    calls = {}
    with torch.inference_mode():
        for side in SIDES:
            pv = torch.randn(side * side, 1176, device="cuda", dtype=torch.bfloat16)
            fn = calls[side] = (lambda pv=pv, side=side: served(pv, [[1, side, side]]))
            for _ in range(3):
                fn()
            wall = statistics.median(timer.wall(fn)[1] * 1e3 for _ in range(10))
            lines.append(f"{side:>6} {side * side:>8} {host_ms(fn):>8.3f} {wall:>8.2f}")
        lines.append(f"cProfile, side {args.profile_side}:")
        lines += profiled(calls[args.profile_side])
    emit(lines, "packed_host_by_image_size")


if __name__ == "__main__":
    main()
