"""Host time of the weight check before every packed call (``weight_watch.py``), in process.

The Qwen2.5-VL-3B-shaped tower (random weights, bf16) served with the defaults and called once;
then ``WeightWatch.moved()`` of its manager, timed when nothing changed, and the padded MLP
copies' own check (``AlignedMLPs.refresh``) beside it. In process, so a change of a few
microseconds is not lost in the call-to-call spread of a whole packed call's host time between
processes (``benchmarks/packed_host_overhead.py``). To compare two source trees, run it once per
tree with ``PYTHONPATH=<tree>/src``.

Usage: python benchmarks/weight_watch_probe.py (CUDA).
"""

from __future__ import annotations

import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from qwen_stream import tower  # noqa: E402

import vit_graph_backend  # noqa: E402


def _per_call_us(fn, calls: int = 3000) -> list[float]:
    return [timeit.timeit(fn, number=calls) / calls * 1e6 for _ in range(3)]


def main() -> None:
    hf = tower()
    served = vit_graph_backend.serve(hf)
    pixels = torch.randn(32 * 32, 3 * 2 * 14 * 14, device="cuda", dtype=torch.bfloat16)
    served(pixels, [[1, 32, 32]])
    torch.cuda.synchronize()
    watch = served.manager._watch
    slots = getattr(watch, "_slots", None)
    watched = len(slots[1]) if slots is not None else 1
    print(f"source {Path(vit_graph_backend.__file__).parent}; device "
          f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; tensors watched {watched}")
    moved = _per_call_us(watch.moved)
    print("WeightWatch.moved(), nothing changed: " + " / ".join(f"{us:.1f}" for us in moved)
          + " us per call")
    aligned = getattr(getattr(served.encoder, "kernels", None), "aligned", None)
    if aligned is not None:
        refresh = _per_call_us(aligned.refresh)
        print("AlignedMLPs.refresh(), nothing changed: "
              + " / ".join(f"{us:.1f}" for us in refresh) + " us per call")


if __name__ == "__main__":
    main()
