"""What the packed path's host caches save per call: each cached step timed with its cache and
without it (the uncached function it wraps), in one process, on this machine's CPU (the host work
of a packed call is the same with or without a GPU).

- ``KEPT_GRIDS`` (``adapters/serve.py``): a list grid's tensor, kept by its rows;
- ``KEPT_SPECS`` (``adapters/packing.py``): a grid's ``EncoderItemSpec``;
- ``PLAN_CACHE_SIZE`` (``runtime/served_budgets.py``): a call's plan, by its tuple of specs.

For calls of 1, 4 and 16 images of mixed sizes (the Qwen2.5-VL-3B tower's geometry: patch 14,
merge 2, the default budgets). Median microseconds a call over ``--reps`` repeats. Usage:
python benchmarks/host_caches.py [--reps 2000]. Text to stdout and ``$OUT/host_caches.txt``.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _bench_out import emit  # noqa: E402

import torch  # noqa: E402

from vit_graph_backend import VitGraphOptions  # noqa: E402
from vit_graph_backend.adapters.inputs import grid_tensor  # noqa: E402
from vit_graph_backend.budgets import packed_budget_range  # noqa: E402
from vit_graph_backend.planner import plan_batches  # noqa: E402
from vit_graph_backend.runtime.served_budgets import ServedBudgets  # noqa: E402
from vit_graph_backend.specs import EncoderItemSpec  # noqa: E402


def median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=2000)
    args = parser.parse_args()
    rng = random.Random(0)
    config = VitGraphOptions(max_items_per_graph=4).resolve(packed_budget_range(14, 2))
    lines = [f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
             f"torch {torch.__version__}; median us a call, with the cache / without",
             f"{'images':>6}  {'grid tensor':>18}  {'item specs':>18}  {'plan':>18}"]
    for n in (1, 4, 16):
        rows = [[1, 2 * rng.randint(8, 48), 2 * rng.randint(8, 48)] for _ in range(n)]
        grids = [tuple(r) for r in rows]
        kept_grids = {tuple(map(tuple, rows)): grid_tensor(rows)}
        kept_specs = {g: EncoderItemSpec(g[0] * g[1] * g[2], g[0] * (g[1] // 2) * (g[2] // 2), 1)
                      for g in grids}
        served = ServedBudgets(config, "baseline", False)
        specs = tuple(kept_specs[g] for g in grids)
        served.plan(specs)
        cells = []
        for cached, fresh in (
            (lambda: kept_grids.get(tuple(map(tuple, rows))), lambda: grid_tensor(rows)),
            (lambda: [kept_specs.get(g) for g in grids],
             lambda: [EncoderItemSpec(t * h * w, t * (h // 2) * (w // 2), t)
                      for t, h, w in grids]),
            (lambda: served.plan(specs),
             lambda: plan_batches(specs, config, policy="baseline", chunk=False)),
        ):
            cells.append(f"{median_us(cached, args.reps):>8.2f} / {median_us(fresh, args.reps):>7.2f}")
        lines.append(f"{n:>6}  " + "  ".join(f"{c:>18}" for c in cells))
    emit(lines, "host_caches")


if __name__ == "__main__":
    main()
