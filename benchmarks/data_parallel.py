"""One table from several ``vitgraph bench --data-parallel`` JSON documents: one GPU
(``vitgraph``) against the world (``vitgraph+dp``) per run.

    python benchmarks/data_parallel.py results/*.json

throughput x: the one-GPU stream time over the data-parallel one (same stream, same run);
imbalance: (busiest rank - idlest rank) / busiest rank, from each rank's busy seconds.
"""

from __future__ import annotations

import json
import sys


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
    return (f"{name:46s} {cfg['world_size']:>2}  {eager['stream_total_s']:8.3f} "
            f"{one['stream_total_s']:8.3f} {dp['stream_total_s']:8.3f} "
            f"{one['stream_total_s'] / dp['stream_total_s']:6.2f}x "
            f"{one['latency_ms']['p50']:7.2f} {dp['latency_ms']['p50']:7.2f} "
            f"{one['latency_ms']['p99']:7.2f} {dp['latency_ms']['p99']:7.2f} "
            f"{imbalance * 100:6.1f} % {_or_nan(dp['max_abs_error']):8.2e}")


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


def main() -> None:
    print(f"{'run':46s} {'ws':>2}  {'eager s':>8} {'1 GPU s':>8} {'dp s':>8} {'thru':>7} "
          f"{'p50 1':>7} {'p50 dp':>7} {'p99 1':>7} {'p99 dp':>7} {'imbal':>8} {'dp err':>8}")
    for path in sys.argv[1:]:
        try:
            print(row(path))
        except (OSError, KeyError, ValueError) as exc:
            print(f"{path}: unreadable ({type(exc).__name__}: {exc})")


if __name__ == "__main__":
    main()
