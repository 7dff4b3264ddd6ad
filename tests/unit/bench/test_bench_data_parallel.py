"""``vitgraph bench --data-parallel`` under ``torchrun``: two CPU ranks on ``gloo``.

The command a user types, launched as a subprocess: each vitgraph mode runs alone and as
``<mode>+dp`` over the two ranks, rank 0 alone prints and writes the document, the data-parallel
outputs equal eager's, and every rank's busy seconds are reported.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("timm")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_bench_data_parallel_under_torchrun(tmp_path):
    out = tmp_path / "dp.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "vit_graph_backend", "bench", "--data-parallel", "--model", "vit-micro",
           "--calls", "8", "--max-batch", "7", "--modes", "eager,vitgraph", "--device", "cpu",
           "--check-calls", "8", "--no-progress", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("vitgraph bench: vit-micro") == 1, "only rank 0 reports"
    doc = json.loads(out.read_text())
    assert doc["config"]["data_parallel"] is True and doc["config"]["world_size"] == 2
    modes = {m["mode"]: m for m in doc["modes"]}
    assert list(modes) == ["eager", "vitgraph", "vitgraph+dp"]
    assert all(m["status"] == "ok" for m in modes.values()), [m["error"] for m in doc["modes"]]
    dp = modes["vitgraph+dp"]
    assert dp["max_abs_error"] < 1e-4  # every call's rows, gathered back, equal eager's
    assert len(dp["rank_busy_s"]) == 2 and min(dp["rank_busy_s"]) > 0
    assert modes["vitgraph"]["rank_busy_s"] is None
    assert "busy s per rank" in done.stdout and "imbalance" in done.stdout
