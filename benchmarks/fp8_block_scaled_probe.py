"""Would 1x128 block scales make ``quantization="fp8"`` pay on CLIP ViT-L/14-336?

Today's FP8 path (``fp8_linear.py``) scales activations per row: fc2's input needs the amax of a
whole 4,096-wide row after the GELU, a reduction Inductor runs in two passes, and that kernel
costs what the FP8 GEMMs save (``docs/performance.md``). With one scale per 128 columns of a row
(DeepSeek-style 1x128 blocks, the weight in 128x128 blocks) the quantization is local to a
128-column tile. This probe asks, at batch 48 (27,696 rows), one layer's shapes:

1. whether this torch's ``torch._scaled_mm`` runs 1x128 x 128x128 block-scaled e4m3 GEMMs on
   this GPU, with which scale layouts, and gives the right numbers (checked against the
   dequantized operands in fp32, so a misread layout shows as a large error);
2. their GPU time against bf16 ``F.linear`` and the row-scaled FP8 GEMM the package runs;
3. the GPU time of the quantizing kernels Inductor makes: GELU (+ bias) then per-row vs 1x128
   quantization of fc1's output, LayerNorm then per-row vs 1x128 of fc1's input.

Times are ``gpu_timing.graph_ms`` (a CUDA graph of 5 calls, median of 5 replays).
Usage: python benchmarks/fp8_block_scaled_probe.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vit_graph_backend.runtime.timing import graph_ms

E4M3 = torch.float8_e4m3fn
MAX = float(torch.finfo(E4M3).max)
ROWS, WIDTH, HIDDEN = 48 * 577, 1024, 4096


def rows_q(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / MAX
    return (x.float() / scale).clamp(-MAX, MAX).to(E4M3), scale


def blocks_q(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 blocks: q [M, K], scales [M, K/128] stored outer-dim-major (stride (1, M))."""
    m, k = x.shape
    blocks = x.float().view(m, k // 128, 128)
    scale = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-12) / MAX
    q = (blocks / scale).clamp(-MAX, MAX).to(E4M3).view(m, k)
    return q, scale.view(m, k // 128).t().contiguous().t()


def weight_blocks_q(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] in 128x128 blocks: q [N, K], scales [N/128, K/128]."""
    n, k = w.shape
    blocks = w.float().view(n // 128, 128, k // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12) / MAX
    q = (blocks / scale).clamp(-MAX, MAX).to(E4M3).view(n, k)
    return q, scale.view(n // 128, k // 128)


def dequant_rows(q, scale):
    return q.float() * scale


def dequant_blocks(q, scale):  # scale [M, K/128]
    return (q.float().view(q.shape[0], -1, 128) * scale.unsqueeze(-1)).view(q.shape)


def dequant_weight(q, scale):  # scale [N/128, K/128]
    n, k = q.shape
    return (q.float().view(n // 128, 128, k // 128, 128) * scale[:, None, :, None]).view(n, k)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def gemms(k: int, n: int, device: str) -> None:
    x = torch.randn(ROWS, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5
    bias = torch.randn(n, device=device, dtype=torch.bfloat16)
    print(f"== GEMM [{ROWS} x {k}] @ [{k} x {n}]")
    print(f"bf16 F.linear + bias: {graph_ms(lambda: F.linear(x, w, bias)):.3f} ms")
    qx, sx = rows_q(x)
    qw, sw = rows_q(w)
    ref = dequant_rows(qx, sx) @ dequant_rows(qw, sw).t()
    row = torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.t().contiguous(),
                           out_dtype=torch.bfloat16)
    print(f"fp8 row-scaled: {graph_ms(lambda: torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.t().contiguous(), bias=bias, out_dtype=torch.bfloat16)):.3f} ms, "  # noqa: E501
          f"error against its dequantized operands {rel(row, ref):.2e}")
    bx, bsx = blocks_q(x)
    bw, bsw = weight_blocks_q(w)
    ref = dequant_blocks(bx, bsx) @ dequant_weight(bw, bsw).t()
    exact = x.float() @ w.float().t()
    # b = W.t() is [K, N] column-major; its 128x128 scales as [K/128, N/128] in two layouts
    for layout, scale_b in (("[K/128, N/128] contiguous", bsw.t().contiguous()),
                            ("[K/128, N/128] = [N/128, K/128].t()", bsw.t())):
        for with_bias in (False, True):
            name = f"fp8 1x128 x 128x128, scale_b {layout}, bias {with_bias}"
            try:
                def call(scale_b=scale_b, with_bias=with_bias):
                    return torch._scaled_mm(bx, bw.t(), scale_a=bsx, scale_b=scale_b,
                                            bias=bias if with_bias else None,
                                            out_dtype=torch.bfloat16)
                out = call()
                if with_bias:
                    out = out - bias
                torch.cuda.synchronize()
                print(f"{name}: {graph_ms(call):.3f} ms, error against its dequantized operands "
                      f"{rel(out, ref):.2e}, against bf16 inputs in fp32 {rel(out, exact):.2e}")
            except Exception as exc:  # noqa: BLE001 - what this torch refuses is the finding
                print(f"{name}: refused: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    print(f"(row-scaled against bf16 inputs in fp32: {rel(row, exact):.2e})")


def quantizers(device: str) -> None:
    h = torch.randn(ROWS, HIDDEN, device=device, dtype=torch.bfloat16)
    b = torch.randn(HIDDEN, device=device, dtype=torch.bfloat16)
    x = torch.randn(ROWS, WIDTH, device=device, dtype=torch.bfloat16)
    ln_w = torch.randn(WIDTH, device=device, dtype=torch.bfloat16)
    ln_b = torch.randn(WIDTH, device=device, dtype=torch.bfloat16)
    cases = {
        "GELU then per-row (fc2's input, today)": (lambda: rows_q(F.gelu(h))),
        "bias + GELU then 1x128": (lambda: blocks_q(F.gelu(h + b))),
        "LayerNorm then per-row (fc1's input, today)":
            (lambda: rows_q(F.layer_norm(x, (WIDTH,), ln_w, ln_b))),
        "LayerNorm then 1x128": (lambda: blocks_q(F.layer_norm(x, (WIDTH,), ln_w, ln_b))),
        "bias + GELU alone, bf16 out (the bf16 path's unfused epilogue)":
            (lambda: F.gelu(h + b)),
    }
    print("== quantizing kernels (torch.compile, Inductor)")
    for name, fn in cases.items():
        compiled = torch.compile(fn, dynamic=False)
        print(f"{name}: {graph_ms(compiled):.3f} ms")


def main() -> None:
    device = "cuda"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}")
    torch.manual_seed(0)
    with torch.no_grad():
        gemms(WIDTH, HIDDEN, device)   # fc1
        gemms(HIDDEN, WIDTH, device)   # fc2
        quantizers(device)


if __name__ == "__main__":
    main()
