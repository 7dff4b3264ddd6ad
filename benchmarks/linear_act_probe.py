"""A linear layer and its activation: cuBLAS then a separate activation kernel (what an Inductor
graph runs today), against one Triton GEMM with the activation in its epilogue
(``vit_graph_backend.kernels._linear_act_triton``), at the MLP shapes of the encoders we serve.

For each shape (rows, K, N, activation), on CUDA in bf16:

- ms per call of: cuBLAS GEMM alone; cuBLAS + Inductor's fused activation (``torch.compile`` of
  ``act(F.linear(x, W, b))``); cuBLAS + our in-place activation kernel; the fused Triton kernel in
  each tile configuration of ``CONFIGS`` (and without the activation, to see the GEMM alone;
  and with the activation's tanh computed exactly instead of by the approximate instruction).
  Each is captured in a CUDA graph of 10 calls and replayed (median of 20 replays), so launch
  overhead is out of the figures.
- the fused kernel's and Inductor's max abs error against a float32 reference.

The gated form (``silu(x @ Wg.T + bg) * (x @ Wu.T + bu)``, Qwen2.5-VL's MLP, width 3420): cuBLAS
for each weight then Inductor's fused SiLU-mul (what the adapter ran before), cuBLAS on the packed
gate/up weight (``fused_linear.pack_gated``, 2 x 3456 rows) then Inductor's SiLU-mul on its views
or our SiLU-mul kernel, and the gated Triton kernel in each 256-wide tile configuration of
``CONFIGS`` (and one warp-specialized).

``occupancy``: CLIP-L's fc1 and SigLIP's at the default configuration beside tiles small enough
that two persistent programs fit one SM (``CONFIGS``' seventh field), so that one's epilogue
overlaps the other's GEMM; the gated shapes likewise in 256-wide tiles.

``cublaslt``: the tanh-GELU shapes (SigLIP's and Qwen3-VL-8B's fc1) beside cuBLASLt's GEMM with the
bias and the GELU in its epilogue (``_compat.addmm_gelu_tanh``, ``torch._addmm_activation``), and
what the op's own timing measured for the same operands.

Usage: python benchmarks/linear_act_probe.py [clip | gated | occupancy | cublaslt] (clip: CLIP-L's
fc1 in the first two configurations only; gated: the gated shapes only). Text to stdout and
$OUT/linear_act_probe.txt.
"""

from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F
from _bench_out import emit
from diagnose import capture

from vit_graph_backend.kernels import _linear_act_triton as K

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
    "siglip fc1 b4": (4 * 729, 1152, 4304, "gelu_tanh"),
    "siglip fc1 b1": (729, 1152, 4304, "gelu_tanh"),
    # Qwen3-VL-8B's vision MLP (SigLIP so400m's width): budgets of its single-image stream
    "qwen3-vl-8b fc1 4096 rows": (4096, 1152, 4304, "gelu_tanh"),
    "qwen3-vl-8b fc1 6396 rows": (6396, 1152, 4304, "gelu_tanh"),
}

#: Qwen2.5-VL-3B's vision MLP: hidden 1280, gate and up 3420 wide padded to 3424, SiLU
GATED_SHAPES = {f"qwen2.5 gate/up {rows} rows": (rows, 1280, 3420)
                for rows in (1024, 4096, 16384)}

#: ``occupancy``: (BM, BN, BK, stages, warps, warp-specialized, programs per SM). Shared memory
#: per program: stages x (BM + BN) x BK x 2 bytes, plus BM x BN bytes for the half-tile store;
#: an H100 SM has 228 KB.
OCCUPANCY_CONFIGS = (
    (128, 256, 64, 3, 8, 0),       # the default, one program per SM
    (128, 128, 64, 4, 8, 0),       # the small-shape default, one per SM
    (128, 128, 64, 2, 4, 0, 2),    # 80 KB a program
    (128, 128, 64, 3, 4, 0, 2),    # 112 KB
    (128, 128, 32, 4, 4, 0, 2),    # 80 KB
    (128, 128, 64, 2, 8, 0, 2),
    (128, 128, 64, 3, 8, 0, 2),
    (64, 256, 64, 2, 4, 0, 2),     # 96 KB
    (64, 256, 64, 3, 4, 0, 2),     # 136 KB: one fits
    (128, 256, 32, 3, 8, 0, 2),    # 104 KB, but 128 accumulator registers a thread
)
REPEAT = 10
#: time the exact-tanh variant of each configuration too (not in ``occupancy``)
EXACT = True
#: ``cublaslt``: also time each shape through the op's own choice and print what it measured
OP_TIMES = False
#: ``--shapes clip``: only CLIP-L's fc1, for quick comparisons of tile configurations
SHAPES = ALL_SHAPES
CONFIGS = K.CONFIGS
GATED_CONFIGS = [c for c in K.CONFIGS if c[1] == 256] + [(128, 256, 64, 3, 8, 1)]


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


def table(lines, title, flops, results, errors):
    """One shape's section: ms, TFLOP/s and max error per mode (an error string where a mode
    failed)."""
    lines.append(f"\n## {title}")
    lines.append(f"{'mode':<40}{'ms':>9}{'TFLOP/s':>9}  max abs err vs fp32")
    for label, ms in results.items():
        err = errors.get(label, "")
        err = f"{err:.2e}" if isinstance(err, float) else err
        lines.append(f"{label:<40}{ms:9.4f}{flops / ms / 1e9:9.0f}  {err}")


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
    if activation == "gelu_tanh":  # cuBLASLt's GEMM with bias and tanh GELU in its epilogue
        from vit_graph_backend._compat import addmm_gelu_tanh

        errors["cublaslt gelu epilogue"] = (addmm_gelu_tanh(x, w, b).float() - ref).abs().max() \
            .item()
        results["cublaslt gelu epilogue"] = ms_per_call(lambda: addmm_gelu_tanh(x, w, b))
        if OP_TIMES:  # what the op's own timing (gpu_timing.graph_ms, 3 calls) measures here
            import logging

            from vit_graph_backend.kernels.fused_linear import linear_act

            seen = []
            handler = logging.Handler()
            handler.emit = lambda record: seen.append(record.getMessage())
            logger = logging.getLogger("vit_graph_backend.kernels.fused_linear")
            logger.addHandler(handler)
            logger.setLevel(logging.DEBUG)
            try:
                linear_act(x, w, b, activation)
            finally:
                logger.removeHandler(handler)
            lines.append(f"the op's own timing: {seen[-1] if seen else 'none logged'}")
    for cfg in CONFIGS:
        label = "fused " + "x".join(map(str, cfg))
        try:
            out = K.linear_act(x, w, b, activation, cfg)
            errors[label] = (out.float() - ref).abs().max().item()
            results[label] = ms_per_call(lambda cfg=cfg: K.linear_act(x, w, b, activation, cfg))
            if activation != "none":
                results[label + " no act"] = ms_per_call(
                    lambda cfg=cfg: K.linear_act(x, w, b, "none", cfg))
                if not EXACT:
                    continue
                out = K.linear_act(x, w, b, activation, cfg, approx=False)
                errors[label + " exact tanh"] = (out.float() - ref).abs().max().item()
                results[label + " exact tanh"] = ms_per_call(
                    lambda cfg=cfg: K.linear_act(x, w, b, activation, cfg, approx=False))
        except Exception as exc:  # a configuration that does not fit this shape
            results[label] = float("nan")
            errors[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    table(lines, f"{name}: rows {rows}, K {k}, N {n}, {activation} ({flops / 1e9:.1f} GFLOP)",
          flops, results, errors)
    best = min((v, k_) for k_, v in results.items()
               if k_.startswith("fused") and k_.count(" ") == 1 and v == v)
    lines.append(f"best fused {best[1]} {best[0]:.4f} ms vs cublas+inductor act "
                 f"{results['cublas+inductor act']:.4f} ms: "
                 f"{results['cublas+inductor act'] / best[0]:.2f}x")


def probe_gated(name, rows, k, width, lines):
    from vit_graph_backend.kernels.fused_linear import GATE_CHUNK, pack_gated

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    gw, uw = (torch.randn(width, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
              for _ in range(2))
    gb, ub = (torch.randn(width, device="cuda", dtype=torch.bfloat16, generator=gen)
              for _ in range(2))
    pw, pb = pack_gated(gw, uw), pack_gated(gb, ub)
    # the adapter's separate copies (epilogue_fusion="off"): zero-padded to a multiple of 8 rows
    pad = -width % 8
    gw8, uw8 = (F.pad(w, (0, 0, 0, pad)) for w in (gw, uw))
    gb8, ub8 = (F.pad(b, (0, pad)) for b in (gb, ub))
    ref = F.silu(F.linear(x.float(), gw.float(), gb.float())) * F.linear(x.float(), uw.float(),
                                                                          ub.float())
    flops = 2 * 2 * rows * k * width
    silu_mul = torch.compile(lambda g, u: F.silu(g) * u, dynamic=False)

    def separate():  # epilogue_fusion="off": two GEMMs on the padded copies + Inductor
        return silu_mul(F.linear(x, gw8, gb8), F.linear(x, uw8, ub8))

    def packed_views():  # epilogue_fusion="off" on the packed copy: one GEMM + Inductor on views
        y = F.linear(x, pw, pb).unflatten(-1, (-1, 2, GATE_CHUNK))
        return silu_mul(y[..., 0, :], y[..., 1, :]).flatten(-2)

    results = {
        "cublas x2 (padded to 8)": ms_per_call(lambda: (F.linear(x, gw8, gb8),
                                                         F.linear(x, uw8, ub8))),
        "cublas x2+inductor silu_mul": ms_per_call(separate),
        "cublas packed": ms_per_call(lambda: F.linear(x, pw, pb)),
        "cublas packed+inductor on views": ms_per_call(packed_views),
        "cublas packed+our silu_mul": ms_per_call(
            lambda: K.silu_mul_packed(F.linear(x, pw, pb), GATE_CHUNK)),
    }
    errors = {"cublas x2+inductor silu_mul": (separate()[:, :width].float() - ref).abs().max()
              .item(),
              "cublas packed+our silu_mul": (K.silu_mul_packed(F.linear(x, pw, pb), GATE_CHUNK)
                                             [:, :width].float() - ref).abs().max().item()}
    for cfg in GATED_CONFIGS:
        label = "gated " + "x".join(map(str, cfg))
        try:
            out = K.linear_act(x, pw, pb, "silu_mul", cfg)
            errors[label] = (out[:, :width].float() - ref).abs().max().item()
            results[label] = ms_per_call(lambda cfg=cfg: K.linear_act(x, pw, pb, "silu_mul", cfg))
        except Exception as exc:  # a configuration that does not fit this shape
            results[label] = float("nan")
            errors[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    table(lines, f"{name}: rows {rows}, K {k}, width {width} (packed {pw.shape[0]}), silu_mul "
          f"({flops / 1e9:.1f} GFLOP of the unpadded MLP)", flops, results, errors)
    best = min((v, k_) for k_, v in results.items() if k_.startswith("gated") and v == v)
    base = results["cublas x2+inductor silu_mul"]
    lines.append(f"best gated {best[1]} {best[0]:.4f} ms vs cublas x2+inductor silu_mul "
                 f"{base:.4f} ms: {base / best[0]:.2f}x; vs cublas packed+inductor on views "
                 f"{results['cublas packed+inductor on views'] / best[0]:.2f}x")


def main():
    global SHAPES, CONFIGS, GATED_CONFIGS, EXACT, OP_TIMES
    gated = dict(GATED_SHAPES)
    if "occupancy" in sys.argv[1:]:
        SHAPES = {k: v for k, v in ALL_SHAPES.items() if "fc1" in k and not k.startswith("vit")}
        CONFIGS, EXACT = OCCUPANCY_CONFIGS, False
        GATED_CONFIGS = [c for c in OCCUPANCY_CONFIGS if c[1] == 256]
    if "gated" in sys.argv[1:]:
        SHAPES = {}
    if "cublaslt" in sys.argv[1:]:  # the tanh-GELU shapes, where cuBLASLt has an epilogue
        gated, EXACT, OP_TIMES = {}, False, True
        SHAPES = {k: v for k, v in ALL_SHAPES.items() if v[3] == "gelu_tanh"}
        CONFIGS = [c for c in K.CONFIGS if c[:3] in ((128, 256, 64), (128, 128, 64))]
    if "clip" in sys.argv[1:]:
        gated = {}
        SHAPES = {k: v for k, v in ALL_SHAPES.items() if k.startswith("clip-l fc1")}
        CONFIGS = K.CONFIGS[:2]
    lines = [f"# linear + activation: cuBLAS + separate kernel vs one Triton GEMM with the "
             f"activation in its epilogue; {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}, bf16, ms per call in a CUDA graph of {REPEAT} calls"]
    for name, shape in SHAPES.items():
        probe(name, *shape, lines)
        print("\n".join(lines[-12:]), flush=True)
    for name, shape in gated.items():
        probe_gated(name, *shape, lines)
        print("\n".join(lines[-12:]), flush=True)
    emit(lines, "linear_act_probe", echo=False)


if __name__ == "__main__":
    main()
