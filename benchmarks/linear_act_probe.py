"""A linear layer and its activation: cuBLAS then a separate activation kernel (what an Inductor
graph runs today), against one Triton GEMM with the activation in its epilogue
(``vit_graph_backend._linear_act_kernels``), at the MLP shapes of the encoders we serve.

For each shape (rows, K, N, activation), on CUDA in bf16:

- ms per call of: cuBLAS GEMM alone; cuBLAS + Inductor's fused activation (``torch.compile`` of
  ``act(F.linear(x, W, b))``); cuBLAS + our in-place activation kernel; the fused Triton kernel in
  each tile configuration of ``CONFIGS`` (and without the activation, to see the GEMM alone;
  and with the activation's tanh computed exactly instead of by the approximate instruction).
  Each is captured in a CUDA graph of 10 calls and replayed (median of 20 replays), so launch
  overhead is out of the figures.
- the fused kernel's and Inductor's max abs error against a float32 reference.

Usage: python benchmarks/linear_act_probe.py [clip] (clip: CLIP-L's fc1 in the first two
configurations only). Text to stdout and $OUT/linear_act_probe.txt.
"""

from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F
from _bench_out import emit
from diagnose import capture

from vit_graph_backend import _linear_act_kernels as K

ALL_SHAPES = {
    # CLIP ViT-L/14-336: 577 tokens per image, hidden 1024, MLP 4096, quick GELU
    "clip-l fc1 b8": (8 * 577, 1024, 4096, "quick_gelu"),
    "clip-l fc1 b24": (24 * 577, 1024, 4096, "quick_gelu"),
    "clip-l fc1 b48": (48 * 577, 1024, 4096, "quick_gelu"),
    "clip-l fc2 b48": (48 * 577, 4096, 1024, "none"),
    "clip-l q/k/v b48": (48 * 577, 1024, 1024, "none"),
    # ViT-B/16: 197 tokens, hidden 768, MLP 3072, exact GELU
    "vit-b fc1 b8": (8 * 197, 768, 3072, "gelu"),
    "vit-b fc1 b32": (32 * 197, 768, 3072, "gelu"),
    # SigLIP so400m/14-384: 729 tokens, hidden 1152, MLP 4304, tanh GELU
    "siglip fc1 b16": (16 * 729, 1152, 4304, "gelu_tanh"),
}

REPEAT = 10
#: ``--shapes clip``: only CLIP-L's fc1, for quick comparisons of tile configurations
SHAPES = ALL_SHAPES
CONFIGS = K.CONFIGS


def reference_act(y, activation):
    if activation == "quick_gelu":
        return y * torch.sigmoid(1.702 * y)
    if activation == "gelu":
        return F.gelu(y)
    if activation == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    return y


def ms_per_call(fn):
    g, _ = capture(lambda: [fn() for _ in range(REPEAT)])
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / REPEAT)
    return statistics.median(times)


def probe(name, rows, k, n, activation, lines):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = reference_act(F.linear(x.float(), w.float(), b.float()), activation)
    flops = 2 * rows * k * n
    compiled = torch.compile(lambda x: reference_act(F.linear(x, w, b), activation))
    results = {
        "cublas": ms_per_call(lambda: F.linear(x, w, b)),
        "cublas+inductor act": ms_per_call(lambda: compiled(x)),
        "cublas+our act": ms_per_call(lambda: K.activation_(F.linear(x, w, b), activation)),
    }
    errors = {"cublas+inductor act": (compiled(x).float() - ref).abs().max().item()}
    for cfg in CONFIGS:
        label = "fused " + "x".join(map(str, cfg))
        try:
            out = K.linear_act(x, w, b, activation, cfg)
            errors[label] = (out.float() - ref).abs().max().item()
            results[label] = ms_per_call(lambda cfg=cfg: K.linear_act(x, w, b, activation, cfg))
            if activation != "none":
                results[label + " no act"] = ms_per_call(
                    lambda cfg=cfg: K.linear_act(x, w, b, "none", cfg))
                out = K.linear_act(x, w, b, activation, cfg, approx=False)
                errors[label + " exact tanh"] = (out.float() - ref).abs().max().item()
                results[label + " exact tanh"] = ms_per_call(
                    lambda cfg=cfg: K.linear_act(x, w, b, activation, cfg, approx=False))
        except Exception as exc:  # a configuration that does not fit this shape
            results[label] = float("nan")
            errors[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    lines.append(f"\n## {name}: rows {rows}, K {k}, N {n}, {activation} "
                 f"({flops / 1e9:.1f} GFLOP)")
    lines.append(f"{'mode':<40}{'ms':>9}{'TFLOP/s':>9}  max abs err vs fp32")
    for label, ms in results.items():
        err = errors.get(label, "")
        err = f"{err:.2e}" if isinstance(err, float) else err
        lines.append(f"{label:<40}{ms:9.4f}{flops / ms / 1e9:9.0f}  {err}")
    best = min((v, k_) for k_, v in results.items()
               if k_.startswith("fused") and k_.count(" ") == 1 and v == v)
    lines.append(f"best fused {best[1]} {best[0]:.4f} ms vs cublas+inductor act "
                 f"{results['cublas+inductor act']:.4f} ms: "
                 f"{results['cublas+inductor act'] / best[0]:.2f}x")


def main():
    global SHAPES, CONFIGS
    if "clip" in sys.argv[1:]:
        SHAPES = {k: v for k, v in ALL_SHAPES.items() if k.startswith("clip-l fc1")}
        CONFIGS = K.CONFIGS[:2]
    lines = [f"# linear + activation: cuBLAS + separate kernel vs one Triton GEMM with the "
             f"activation in its epilogue; {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}, bf16, ms per call in a CUDA graph of {REPEAT} calls"]
    for name, shape in SHAPES.items():
        probe(name, *shape, lines)
        print("\n".join(lines[-12:]), flush=True)
    emit(lines, "linear_act_probe", echo=False)


if __name__ == "__main__":
    main()
