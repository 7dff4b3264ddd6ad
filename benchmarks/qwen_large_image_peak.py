"""Fraction of the matmul peak on one large image: the Qwen2.5-VL-3B-shaped tower, served with the
defaults (segment attention through cuDNN where ``nvidia-cudnn-frontend`` is installed, else
flash varlen: ``adapters/_attention_choice.py``), with ``attention="varlen"`` (flash varlen
always) and with ``max_items_per_graph=1`` (budgets of one image), against HF eager, at 1,024 /
4,096 / 16,384 patches (32 x 32, 64 x 64, 128 x 128; one image per call, bf16, random weights).

FLOPs per call are counted by PyTorch's ``FlopCounterMode`` on the HF tower's eager forward
(``vit_graph_backend.bench.roofline.count_stream_flops``); the bf16 matmul peak is measured
in the same run (``matmul_peak_tflops``). Times are medians of CUDA-synchronized calls after a
warm-up (the served tower's first call captures its graphs).

``--modes`` picks among those, ``epilogue-off`` (``epilogue_fusion="off"``: the gated MLP's
GEMMs through cuBLAS and a separate SiLU-mul kernel) and ``windows-flash`` (the defaults with the
window layers on flash varlen instead of the short-segment kernel) and ``dense`` (budgets of one
image whose full attention is dense SDPA over the widened heads: ``_packed_attention``) and
``cudnn`` (full attention always through cuDNN's ragged kernel, never the Triton segment kernel
that the defaults time against it per budget: ``_attention_choice``).

``--back-to-back`` adds a second table: the same calls issued ``--reps`` at a time with no sync
between them (wall of the run over its calls), where each call's host work overlaps the GPU work
of the call before: the per-call time of a stream of large images, against the first table's
latency of one call on an idle GPU.

Usage: python benchmarks/qwen_large_image_peak.py [--reps 20] [--modes vitgraph,varlen,...]
[--back-to-back]. Text to stdout and to $OUT/qwen_large_image_peak.txt when $OUT is set.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _bench_out import emit  # noqa: E402
from qwen_stream import flash_windows, tower  # noqa: E402

from vit_graph_backend import serve  # noqa: E402
from vit_graph_backend.bench.roofline import (  # noqa: E402
    count_stream_flops,
    matmul_peak_tflops,
)
from vit_graph_backend.bench.timing import CallTimer  # noqa: E402

SIDES = (32, 64, 128)
#: Each mode's serve() settings beside the defaults.
SETTINGS = {"vitgraph": {}, "varlen": {"attention": "varlen"},
            "1-item": {"max_items_per_graph": 1}, "epilogue-off": {"epilogue_fusion": "off"},
            "windows-flash": {}, "dense": {"attention": "dense", "max_items_per_graph": 1},
            "cudnn": {"attention": "cudnn"}}
#: Modes that change the served tower after serve(): the defaults with window layers on flash
#: varlen instead of the short-segment kernel.
AFTER = {"windows-flash": flash_windows}


def median_ms(fn, reps: int) -> float:
    """Median wall ms of ``fn()`` between device syncs, after 3 warm-up calls."""
    timer = CallTimer("cuda")
    for _ in range(3):
        fn()
    return statistics.median(timer.wall(fn)[1] * 1e3 for _ in range(reps))


def back_to_back_ms(fn, reps: int) -> tuple[float, float]:
    """Wall ms per call of ``reps`` calls of ``fn`` issued with no sync between them (after 3
    warm-up calls), and the host's ms per call to issue them (the calls returned, the GPU maybe
    still busy): medians of 3 such runs. An issue time near the wall means the calls wait for
    the GPU somewhere; far below it, the host's work hides behind the GPU's."""
    timer = CallTimer("cuda")
    for _ in range(3):
        fn()
    walls, issues = [], []
    for _ in range(3):
        issued = []

        def run() -> None:
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            issued.append(time.perf_counter() - start)

        walls.append(timer.wall(run)[1] * 1e3 / reps)
        issues.append(issued[0] * 1e3 / reps)
    return statistics.median(walls), statistics.median(issues)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--modes", default="vitgraph,varlen,1-item",
                        help="comma-separated, from: " + ", ".join(SETTINGS))
    parser.add_argument("--back-to-back", action="store_true",
                        help="also time calls issued with no sync between them")
    args = parser.parse_args()
    hf = tower()
    modes = {name: AFTER.get(name, lambda served: served)(serve(hf, **SETTINGS[name]))
             for name in args.modes.split(",")}
    peak = matmul_peak_tflops("cuda", torch.bfloat16)
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; Qwen2.5-VL-3B-"
             f"shaped tower, one image per call, bf16; matmul peak {peak:.0f} TFLOP/s (measured)",
             "vitgraph: defaults (segment kernel: "
             f"{next(iter(modes.values())).encoder.attention_state['segments']}); "
             + "; ".join(f"{name}: {SETTINGS[name]}" for name in modes)
             + "; each mode: ms, fraction of peak",
             f"{'patches':>8}{'GFLOP':>9}{'eager':>16}"
             + "".join(f"{name:>22}" for name in modes) + f"{'speed-up':>10}"]
    with torch.inference_mode():
        for side in SIDES:
            grid = torch.tensor([[1, side, side]], device="cuda")
            pv = torch.randn(side * side, 1176, device="cuda", dtype=torch.bfloat16)
            flops = count_stream_flops(hf, [(pv, grid)])
            times = [median_ms(lambda: hf(pv, grid), args.reps)]
            times += [median_ms(lambda fn=fn: fn(pv, [[1, side, side]]), args.reps)
                      for fn in modes.values()]
            frac = [flops / (ms / 1e3) / 1e12 / peak for ms in times]
            lines.append(f"{side * side:>8}{flops / 1e9:>9.0f}"
                         + "".join(f"{ms:>10.2f}{f:>6.2f}" if i == 0 else f"{ms:>16.2f}{f:>6.2f}"
                                   for i, (ms, f) in enumerate(zip(times, frac, strict=True)))
                         + f"{times[0] / times[1]:>9.2f}x")
            if args.back_to_back:
                runs = [back_to_back_ms(lambda: hf(pv, grid), args.reps)]
                runs += [back_to_back_ms(lambda fn=fn: fn(pv, [[1, side, side]]), args.reps)
                         for fn in modes.values()]
                streamed = [ms for ms, _ in runs]
                lines.append(f"{'':>8}{'back to back':>9}"
                             + "".join(f"{ms:>10.2f}{flops / (ms / 1e3) / 1e12 / peak:>6.2f}"
                                       if i == 0 else
                                       f"{ms:>16.2f}{flops / (ms / 1e3) / 1e12 / peak:>6.2f}"
                                       for i, ms in enumerate(streamed))
                             + f"{streamed[0] / streamed[1]:>9.2f}x"
                             + "  issued in " + " / ".join(f"{issue:.2f}" for _, issue in runs)
                             + " ms per call")
    for name, mode in modes.items():
        report, state = mode.report(), mode.encoder.attention_state
        lines.append(f"{name}: graphs {report.get('graphs_captured')}, eager items "
                     f"{report.get('stats', {}).get('eager_items')}; segments {state['segments']}"
                     f" {state['cudnn']}; full attention by static rows {state['by_rows']}, "
                     f"segment kernel {state['full']['by_rows']} (ms {state['full']['timings_ms']})"
                     f"; windows by static rows {state['windows']['by_rows']}")
    emit(lines, "qwen_large_image_peak")


if __name__ == "__main__":
    main()
