"""Why one packed call's host time is several times larger right after a device sync than when
calls are issued back to back (``benchmarks/results/packed_call_host_time_by_image_size_*``
against ``qwen2_5_vl_3b_large_image_one_call_vs_back_to_back_issue_time_and_sm_clocks_*``).

The Qwen2.5-VL-3B-shaped tower (random weights, bf16, defaults), one image of ``--side`` x
``--side`` patches per call, the grid as a list; the host time of one call (call to return,
median of 15) in four conditions:

- ``after sync``: right after ``torch.cuda.synchronize()``, the GPU idle;
- ``after sync + CPU spin``: the same, then 2 ms of a busy Python loop before the call (the CPU
  kept running the interpreter, the GPU idle);
- ``after sync + one launch``: the same, then one tiny CUDA op before the call (any first-launch-
  after-idle cost paid outside the call);
- ``GPU busy``: after a sync, 20 large matmuls queued first (tens of ms of GPU work), so the call
  is issued while the GPU is busy, as in a stream.

Then ``cProfile`` of 15 calls in the first and the last condition: the functions whose own time
differs most, in microseconds per call.

Usage: python benchmarks/packed_host_after_sync_probe.py [--side 64]. Text to stdout and to
$OUT/packed_host_after_sync_probe.txt when $OUT is set.
"""

from __future__ import annotations

import argparse
import cProfile
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _bench_out import emit  # noqa: E402
from packed_host_overhead import profile_rows  # noqa: E402
from qwen_stream import tower  # noqa: E402

from vit_graph_backend import serve  # noqa: E402


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--side", type=int, default=64)
    args = parser.parse_args()
    served = serve(tower())
    side = args.side
    pv = torch.randn(side * side, 1176, device="cuda", dtype=torch.bfloat16)
    grid = [[1, side, side]]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    tiny = torch.zeros(1, device="cuda")

    def busy() -> None:
        for _ in range(20):
            torch.mm(a, a)

    setups = {"after sync": lambda: None, "after sync + CPU spin": lambda: _spin(2e-3),
              "after sync + one launch": lambda: tiny.add_(1), "GPU busy": busy}

    def host_ms(setup) -> float:
        torch.cuda.synchronize()
        setup()
        start = time.perf_counter()
        served(pv, grid)
        ms = (time.perf_counter() - start) * 1e3
        torch.cuda.synchronize()
        return ms

    with torch.inference_mode():
        for _ in range(5):
            served(pv, grid)
        lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
                 f"Qwen2.5-VL-3B-shaped tower, one image of {side * side} patches a call",
                 f"{'condition':<28}{'host ms, median of 15':>24}{'min':>8}"]
        for name, setup in setups.items():
            times = [host_ms(setup) for _ in range(15)]
            lines.append(f"{name:<28}{statistics.median(times):>24.3f}{min(times):>8.3f}")
        own = {}
        for name in ("after sync", "GPU busy"):
            prof = cProfile.Profile()
            for _ in range(15):
                torch.cuda.synchronize()
                setups[name]()
                prof.enable()
                served(pv, grid)
                prof.disable()
            torch.cuda.synchronize()
            own[name] = {where: us for us, _, _, where in profile_rows(prof, 15)}
    keys = set(own["after sync"]) | set(own["GPU busy"])
    diff = sorted(keys, key=lambda k: own["GPU busy"].get(k, 0) - own["after sync"].get(k, 0))
    lines.append("cProfile own us per call, after sync vs GPU busy, largest differences:")
    lines += [f"    {own['after sync'].get(k, 0):8.1f} {own['GPU busy'].get(k, 0):8.1f}  {k[:90]}"
              for k in diff[:12]]
    emit(lines, "packed_host_after_sync_probe")


if __name__ == "__main__":
    main()
