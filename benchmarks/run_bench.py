"""Run ``vitgraph bench`` and keep its JSON in ``benchmarks/results/``.

A thin wrapper: every argument goes to ``vitgraph bench`` unchanged; this script only picks the
file name, ``bench_<model>_<workload>_<device name>_torch<version>.json``, so results from
different machines and torch versions sit side by side (the device and versions are also inside
the document, under ``environment``). A PNG of the latency distribution is written next to it.

Usage::

    python benchmarks/run_bench.py                      # the device's defaults
    python benchmarks/run_bench.py --model qwen2.5-vl --workload mixed-sizes --calls 60
    python benchmarks/run_bench.py --out-dir /tmp/results --no-plot ...
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_")


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--out-dir", type=Path, default=RESULTS)
    pre.add_argument("--no-plot", action="store_true")
    pre.add_argument("--model")
    pre.add_argument("--workload", default="uniform-batch")
    pre.add_argument("--device")
    ours, rest = pre.parse_known_args(argv)
    if any(a in ("--json", "--plot") or a.startswith(("--json=", "--plot=")) for a in rest):
        pre.error("--json and --plot are chosen by this script (use --out-dir)")

    import torch

    from vit_graph_backend.bench import BenchConfig, resolve
    from vit_graph_backend.bench.environment import collect_environment
    from vit_graph_backend.cli import main as vitgraph

    defaults = resolve(BenchConfig(model=ours.model, workload=ours.workload, device=ours.device),
                       cuda_available=torch.cuda.is_available()).config
    device, model = defaults.device, defaults.model
    env = collect_environment(device)
    stem = (f"bench_{model}_{ours.workload}_{_slug(env['device_name'])}"
            f"_torch{_slug(env['torch'].split('+')[0])}")
    args = ["bench", "--model", model, "--workload", ours.workload, "--device", device, *rest,
            "--json", str(ours.out_dir / f"{stem}.json")]
    if not ours.no_plot:
        args += ["--plot", str(ours.out_dir / f"{stem}.png")]
    return vitgraph(args)


if __name__ == "__main__":
    sys.exit(main())
