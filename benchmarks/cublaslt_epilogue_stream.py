"""``vitgraph bench`` on one model with the linear+activation op's cuBLASLt candidate (the GEMM
with bias and tanh GELU in its epilogue, ``fused_linear._CUBLASLT``) timed as usual, or refused
for the whole process (``off``: the baseline), then what the op chose per shape, counted.

Usage: python benchmarks/cublaslt_epilogue_stream.py on|off [vitgraph bench arguments...]
(run both in one device call, alternated: each is a process of its own)."""

from __future__ import annotations

import collections
import sys

from vit_graph_backend.cli import main
from vit_graph_backend.kernels.fused_linear import CHOICES

if __name__ == "__main__":
    which, args = sys.argv[1], sys.argv[2:]
    if which not in ("on", "off"):
        raise SystemExit(f"first argument {which!r}: 'on' or 'off'")
    if which == "off":
        CHOICES.refused[(False, "cublaslt epilogue")] = "refused for this run's baseline"
    status = main(["bench", "--no-progress", *args])
    chosen = CHOICES.state["chosen"]
    print(f"cuBLASLt candidate {which}: the op chose, over {len(chosen)} shapes:",
          dict(collections.Counter(chosen.values())))
    for shape, choice in sorted(chosen.items()):
        print(f"  {shape}: {choice}")
    sys.exit(status)
