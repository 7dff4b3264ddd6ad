"""One table from several ``vitgraph bench --data-parallel`` JSON documents: one GPU
(``vitgraph``) against the world (``vitgraph+dp``) per run.

    python benchmarks/data_parallel.py results/*.json
    python benchmarks/data_parallel.py --run [--nproc 2]   # run the grid below first, then tabulate
    VITGRAPH_DP_ROWS=2,5 python benchmarks/data_parallel.py --run   # rows 2 and 5 of the grid

``--run`` launches ``torchrun --nproc-per-node N -m vit_graph_backend bench --data-parallel`` for
each row of :data:`GRID` (the Qwen2.5-VL-3B tower and CLIP ViT-L/14-336 at 8, 16 and 32 items a
call, a video stream, and calls of 1, 2 and 4 items: the crossover below which a call is better run
whole), writing ``$OUT/dp_<model>_<workload>_<max-batch>.json`` (one-GPU vitgraph and vitgraph+dp; the
eager column is filled for documents run with eager too).

throughput x: the one-GPU stream time over the data-parallel one (same stream, same run);
imbalance: (busiest rank - idlest rank) / busiest rank, from each rank's busy seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

#: (model, workload, max-batch, calls) of ``--run``
GRID = [("qwen2.5-vl", "mixed-batch", n, 12) for n in (8, 16, 32)] + [
    ("clip-l14-336", "fixed-batch", n, 12) for n in (8, 16, 32)] + [
    ("qwen2.5-vl", "video", 4, 8)] + [
    ("qwen2.5-vl", "fixed-batch", n, 16) for n in (1, 2, 4)] + [
    ("clip-l14-336", "fixed-batch", n, 16) for n in (1, 2, 4)]


def run_grid(nproc: int, rows: list[int] | None = None) -> list[str]:
    """Run :data:`GRID` (its ``rows``, default all) under torchrun; the JSON paths written."""
    out = Path(os.environ.get("OUT", "/tmp/vitgraph_out"))
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (model, workload, batch, calls) in enumerate(GRID):
        if rows is not None and i not in rows:
            continue
        path = out / f"dp_{model}_{workload}_{batch}.json"
        path.unlink(missing_ok=True)  # a failed run must not show an older file's row
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "-m", "vit_graph_backend", "bench",
               "--data-parallel", "--model", model, "--workload", workload, "--max-batch",
               str(batch), "--calls", str(calls), "--modes", "vitgraph", "--no-progress",
               "--json", str(path)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{path.name}: exit {done.returncode}: {done.stderr[-400:]}", flush=True)
        paths.append(str(path))
        try:
            print(row(str(path)), flush=True)
        except (OSError, KeyError, ValueError) as exc:   # the grid goes on
            print(f"{path}: unreadable ({type(exc).__name__}: {exc})", flush=True)
    return paths


def row(path: str) -> str:
    doc = json.load(open(path))
    cfg, modes = doc["config"], {m["mode"]: m for m in doc["modes"]}
    one, dp, eager = modes.get("vitgraph"), modes.get("vitgraph+dp"), modes.get("eager")
    name = f"{cfg['model']} {cfg['workload']} max-batch {cfg['max_batch']}"
    if not (one and dp and one["status"] == dp["status"] == "ok"):
        errors = [m.get("error") for m in (one, dp) if m and m["status"] != "ok"]
        return f"{name:46s} failed: {errors}"
    busy = dp["rank_busy_s"] or [0.0]
    imbalance = (max(busy) - min(busy)) / max(busy) if max(busy) > 0 else float("nan")
    eager_s = eager["stream_total_s"] if eager else float("nan")
    return (f"{name:46s} {cfg['world_size']:>2}  {eager_s:8.3f} "
            f"{one['stream_total_s']:8.3f} {dp['stream_total_s']:8.3f} "
            f"{one['stream_total_s'] / dp['stream_total_s']:6.2f}x "
            f"{one['latency_ms']['p50']:7.2f} {dp['latency_ms']['p50']:7.2f} "
            f"{one['latency_ms']['p99']:7.2f} {dp['latency_ms']['p99']:7.2f} "
            f"{imbalance * 100:6.1f} % {_or_nan(dp['max_abs_error']):8.2e}")


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


def main() -> None:
    paths = sys.argv[1:]
    if paths[:1] == ["--run"]:
        nproc = int(paths[2]) if paths[1:2] == ["--nproc"] else 2
        rows = os.environ.get("VITGRAPH_DP_ROWS")
        paths = run_grid(nproc, [int(r) for r in rows.split(",")] if rows else None)
    print(f"{'run':46s} {'ws':>2}  {'eager s':>8} {'1 GPU s':>8} {'dp s':>8} {'thru':>7} "
          f"{'p50 1':>7} {'p50 dp':>7} {'p99 1':>7} {'p99 dp':>7} {'imbal':>8} {'dp err':>8}")
    for path in paths:
        try:
            print(row(path))
        except (OSError, KeyError, ValueError) as exc:
            print(f"{path}: unreadable ({type(exc).__name__}: {exc})")


if __name__ == "__main__":
    main()
