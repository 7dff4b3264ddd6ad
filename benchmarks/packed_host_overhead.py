"""Host time of one packed call, and what in it waits for the GPU.

The Qwen2.5-VL-3B-shaped tower (random weights, bf16) served with the defaults, one image per call
of 448 to 896 px. Its GPU work (several ms) is far longer than the host's, so a call that returns
to Python before the GPU finishes shows its true host time; a call whose host time grows to the GPU
time hides a blocking device-to-host sync or a pageable copy that waits for the stream.

Per grid form (a CUDA tensor, as ``generate()`` passes it; a CPU tensor, as the processor makes
it; a list): median host ms (call start to return, no sync) and total ms (to the end of the GPU
work). Then ``cProfile`` of 50 calls with a CUDA grid: the top host functions by own time.

Usage: python benchmarks/packed_host_overhead.py. Text to stdout and $OUT when set.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from qwen_stream import tower  # noqa: E402

from vit_graph_backend import serve  # noqa: E402


def calls(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        grid = [[1, rng.randrange(448, 897, 28) // 14, rng.randrange(448, 897, 28) // 14]]
        rows = grid[0][1] * grid[0][2]
        out.append((torch.randn(rows, 1176, device="cuda", dtype=torch.bfloat16), grid))
    return out


def main():
    served = serve(tower())
    stream = calls(40)
    forms = {"cuda tensor": lambda g: torch.tensor(g, device="cuda"),
             "cpu tensor": lambda g: torch.tensor(g), "list": lambda g: g}
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
             "Qwen2.5-VL-3B-shaped tower, one image of 448..896 px per call",
             f"{'grid':<12}{'host ms p50':>12}{'total ms p50':>14}"]
    with torch.inference_mode():
        for pv, g in stream:  # first pass: captures
            served(pv, forms["cuda tensor"](g))
        for name, form in forms.items():
            args = [(pv, form(g)) for pv, g in stream]
            host, total = [], []
            for _ in range(3):
                for pv, grid in args:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    served(pv, grid)
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    host.append((t1 - t0) * 1e3)
                    total.append((time.perf_counter() - t0) * 1e3)
            lines.append(f"{name:<12}{statistics.median(host):12.3f}"
                         f"{statistics.median(total):14.3f}")
        args = [(pv, forms["cuda tensor"](g)) for pv, g in stream]
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for pv, grid in args[:50]:
            served(pv, grid)
        prof.disable()
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    lines += ["", "cProfile, CUDA grid, 40 calls, by own time:",
              *[ln for ln in buf.getvalue().splitlines() if ln.strip()][4:]]
    text = "\n".join(lines)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "packed_host_overhead.txt").write_text(text)


if __name__ == "__main__":
    main()
