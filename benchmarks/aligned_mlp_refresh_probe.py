"""Host time of ``AlignedMLPs.refresh`` when nothing changed: the check that runs before every
packed call of the Qwen2.5-VL-3B-shaped tower (``adapters/_aligned_mlp.py``: its 160 MLP
parameters read from their modules' tables, then addresses and version counters).

In process, so it is not swamped by the call-to-call spread of a whole packed call's host time
between processes (``benchmarks/packed_host_overhead.py``). To compare two source trees, run it
once per tree with ``PYTHONPATH=<tree>/src``.

Usage: python benchmarks/aligned_mlp_refresh_probe.py (CUDA).
"""

from __future__ import annotations

import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from qwen_stream import tower  # noqa: E402

import vit_graph_backend  # noqa: E402
from vit_graph_backend.adapters.aligned_mlp import AlignedMLPs  # noqa: E402
from vit_graph_backend.weight_watch import registrations  # noqa: E402


def main() -> None:
    hf = tower()
    aligned = AlignedMLPs([block.mlp for block in hf.blocks], gated=True)
    print(f"source {Path(vit_graph_backend.__file__).parent}; device "
          f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; {len(hf.blocks)} blocks")
    aligned.refresh()
    torch.cuda.synchronize()
    start, calls = registrations(), 3000
    for _ in range(3):
        us = timeit.timeit(aligned.refresh, number=calls) / calls * 1e6
        print(f"refresh, nothing changed: {us:.1f} us per call (parameter registrations "
              f"meanwhile: {registrations() - start})")


if __name__ == "__main__":
    main()
