"""How ``epilogue_fusion``'s per-shape choice is timed, and what each timing picks.

For each MLP shape of the encoders we serve (CLIP ViT-L/14-336 and ViT-B/16 fc1 across batch
sizes, Qwen2.5-VL-3B's gated MLP and Qwen3-VL-8B's fc1 across budget rows), every candidate of
``fused_linear`` (cuBLAS + the activation kernel, each fused tile configuration) is timed two
ways on the same tensors:

- ``launch``: single launches timed with CUDA events, median of 5 after one untimed run (what
  ``fused_linear`` did before ``gpu_timing.graph_ms``);
- ``graph``: ``gpu_timing.graph_ms``, replays of a CUDA graph of 5 calls (what it does now).

Each row names the candidate each timing picks, and the graph time of both picks (what the
budget's graph pays for the choice): where the launch timing picks a candidate the graph runs
slower, the last column says how much slower.

Usage: python benchmarks/linear_act_choice_timing.py. Text to stdout and
$OUT/linear_act_choice_timing.txt.
"""

from __future__ import annotations

import statistics

import torch
from _bench_out import emit

from vit_graph_backend.kernels import fused_linear
from vit_graph_backend.bench.timing import CallTimer
from vit_graph_backend.runtime.timing import graph_ms

# (label, rows, K, N, activation): N is the gated MLP's unpacked width
SHAPES = ([(f"clip-l fc1 b{b}", 577 * b, 1024, 4096, "quick_gelu")
           for b in (1, 2, 4, 8, 16, 24, 48)]
          + [(f"vit-b fc1 b{b}", 197 * b, 768, 3072, "gelu") for b in (1, 2, 4, 8, 16, 32)]
          + [(f"qwen2.5 gate/up {r} rows", r, 1280, 3420, fused_linear.GATED)
             for r in (256, 1024, 4096, 16384)]
          + [(f"qwen3-8b fc1 {r} rows", r, 1152, 4304, "gelu_tanh")
             for r in (196, 784, 3136, 6724)])


def launch_ms(fn, runs=5):
    """Median ms of single launches timed with events (the GPU idle at each)."""
    fn()
    timer = CallTimer("cuda")
    return statistics.median(timer.time_call(fn, ())[1] for _ in range(runs))


def operands(rows, k, n, activation):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    if activation == fused_linear.GATED:   # packed gate/up, as the adapters hold them
        w2 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
        w, b = fused_linear.pack_gated(w, w2), fused_linear.pack_gated(b, b.flip(0))
    return x, w, b


def main():
    device = torch.cuda.get_device_name(0)
    lines = [f"# fused_linear choice: single launches timed with events vs gpu_timing.graph_ms; "
             f"{device}, torch {torch.__version__}, bf16; ms per call",
             f"{'shape':<26}{'launch pick':>28}{'graph pick':>28}{'graph ms of picks':>24}"
             f"{'launch pick slower':>20}"]
    choices = fused_linear.CHOICES
    for label, rows, k, n, activation in SHAPES:
        x, w, b = operands(rows, k, n, activation)
        gated = activation == fused_linear.GATED
        configs = fused_linear.GATED_CONFIGS if gated else fused_linear.FUSED_CONFIGS
        candidates = [fused_linear._UNFUSED, *configs]
        launch, graph = {}, {}
        for choice in candidates:
            def run(choice=choice):
                return choices._launch(choice, x, w, b, activation)
            launch[choice] = launch_ms(run)
            graph[choice] = graph_ms(run)
        by_launch = min(launch, key=launch.__getitem__)
        by_graph = min(graph, key=graph.__getitem__)
        slower = graph[by_launch] / graph[by_graph] - 1
        lines.append(f"{label:<26}{fused_linear._name(by_launch):>28}"
                     f"{fused_linear._name(by_graph):>28}"
                     f"{graph[by_launch]:>11.4f} /{graph[by_graph]:>9.4f}{slower:>19.1%}")
        lines.append("    " + ", ".join(f"{fused_linear._name(c)}: launch {launch[c]:.4f} graph "
                                        f"{graph[c]:.4f}" for c in candidates))
        print(lines[-2], flush=True)
    emit(lines, "linear_act_choice_timing")


if __name__ == "__main__":
    main()
