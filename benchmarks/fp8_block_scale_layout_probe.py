"""Which scale does ``torch._scaled_mm``'s 1x128 x 128x128 block-scaled e4m3 GEMM apply where,
called with the layouts it accepts (scale_a [M, K/128] strides (1, M), the weight's
[N/128, K/128] scales transposed) at a K of 2 blocks and an N of 3?

All-ones operands (M=256, K=256, N=384: two blocks of K, three of N), bf16 output, every scale 1
but one set to 2: a correct GEMM changes exactly that row (activation scale [row, k-block]) or
that block of 128 columns (weight scale [n-block, k-block]) from 256 to 384, and nothing else.
Then random small integers with power-of-two scales (exact in fp32), with and without a bias,
against the dequantized product, for several row counts.

    python benchmarks/fp8_block_scale_layout_probe.py
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
M, K, N = 256, 256, 384


def gemm(a, w, scale_a, scale_w, bias=None):
    """The package's call: scale_a [M, K/128] strides (1, M); scale_w [N/128, K/128] passed
    transposed."""
    return torch._scaled_mm(a.to(E4M3), w.to(E4M3).t(), scale_a=scale_a.t().contiguous().t(),
                            scale_b=scale_w.t(), bias=bias, out_dtype=torch.bfloat16).float()


def where_changed(out: torch.Tensor) -> str:
    rows, cols = (out != 256).nonzero(as_tuple=True)
    if not len(rows):
        return "nothing changed"
    values = sorted(set(out[rows, cols].tolist()))
    return (f"{len(rows)} outputs changed: rows {sorted(set(rows.tolist()))[:6]}"
            f"{'...' if len(set(rows.tolist())) > 6 else ''}, column blocks "
            f"{sorted(set((cols // 128).tolist()))}, values {values[:4]}")


@torch.no_grad()
def main() -> None:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}")
    a = torch.ones(M, K, device="cuda")
    w = torch.ones(N, K, device="cuda")
    ones_a = torch.ones(M, K // 128, device="cuda")
    ones_w = torch.ones(N // 128, K // 128, device="cuda")
    print(f"all scales 1: {where_changed(gemm(a, w, ones_a, ones_w))}")
    for row, kb in ((0, 0), (5, 1), (200, 0)):
        scale = ones_a.clone()
        scale[row, kb] = 2
        print(f"activation scale [{row}, {kb}] = 2 (expected: row {row}, all column blocks, 384):"
              f" {where_changed(gemm(a, w, scale, ones_w))}")
    for nb, kb in ((0, 0), (1, 0), (2, 1)):
        scale = ones_w.clone()
        scale[nb, kb] = 2
        print(f"weight scale [{nb}, {kb}] = 2 (expected: all rows, column block {nb}, 384): "
              f"{where_changed(gemm(a, w, ones_a, scale))}")
    bias = torch.zeros(N, device="cuda", dtype=torch.bfloat16)
    bias[128:256] = 64
    print(f"bias 64 on column block 1 (expected: all rows, block 1, 320): "
          f"{where_changed(gemm(a, w, ones_a, ones_w, bias))}")
    for rows in (256, 1000, 1024, 27696):
        gen = torch.Generator(device="cuda").manual_seed(rows)
        ai = torch.randint(-4, 5, (rows, K), device="cuda", generator=gen).float()
        wi = torch.randint(-4, 5, (N, K), device="cuda", generator=gen).float()
        for spread in (1, 3):
            sa = 2.0 ** torch.randint(-spread, spread + 1, (rows, K // 128), device="cuda",
                                      generator=gen).float()
            sw = 2.0 ** torch.randint(-spread, spread + 1, (N // 128, K // 128), device="cuda",
                                      generator=gen).float()
            deq = (ai * sa.repeat_interleave(128, 1)) @ (
                wi * sw.repeat_interleave(128, 0).repeat_interleave(128, 1)).t()
            for with_bias in (False, True):
                b = (torch.arange(N, device="cuda") / 8).to(torch.bfloat16) if with_bias else None
                out = gemm(ai, wi, sa, sw, b)
                ref = (deq + (b.float() if with_bias else 0)).to(torch.bfloat16).float()
                wrong = (out != ref).float().mean().item()
                print(f"rows {rows}, scales 2**[-{spread}, {spread}], bias {with_bias}: "
                      f"{wrong:.1%} of outputs differ from the dequantized product, max "
                      f"{(out - ref).abs().max().item():.4g} (outputs up to "
                      f"{ref.abs().max().item():.4g})")


if __name__ == "__main__":
    main()
