"""Which way does the block-scaled e4m3 GEMM write its output, and can the transposed problem
give the next kernel rows to read?

At CLIP ViT-L/14-336's fc2 with 48 images (27,696 rows, K 4,096, N 1,024), three ways:

- ``rows``: the row-scaled GEMM the package runs (``torch._scaled_mm``);
- ``blocks``: ``F.scaled_mm`` with 1x128 activation scales and 128x128 weight scales;
- ``blocks, transposed``: ``out.T = W @ x.T`` with 1x128 scales on both sides (the weight's per
  row and 128 columns), so the activations' 1x128 scales serve as they are.

For each: the output's strides, its error against the dequantized operands, its GPU time, and
the time of the GEMM followed by what follows fc2 in the graph (residual add and LayerNorm,
compiled by Inductor), which reads the output row by row.

    python benchmarks/fp8_block_scaled_output_layout_probe.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vit_graph_backend.runtime.timing import graph_ms

E4M3 = torch.float8_e4m3fn
MAX = 448.0
M, K, N = 27696, 4096, 1024


def q_rows(x):
    s = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / MAX
    return (x.float() / s).to(E4M3), s


def q_blocks(x):  # [R, K] -> q, scales [R, K/128] strides (1, R)
    r = x.shape[0]
    b = x.float().reshape(r, K // 128, 128)
    s = b.abs().amax(-1).clamp(min=1e-12) / MAX
    return (b / s.unsqueeze(-1)).to(E4M3).reshape(r, K), s.t().contiguous().t()


def main() -> None:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}")
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 64
    resid = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    ln_w = torch.ones(N, device="cuda", dtype=torch.bfloat16)
    st = F.ScalingType
    qx, sx = q_blocks(x)
    rq, rs = q_rows(x)
    wr, wrs = q_rows(w)
    wq128 = w.float().reshape(N // 128, 128, K // 128, 128)
    ws128 = wq128.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12) / MAX
    wb = (wq128 / ws128).to(E4M3).reshape(N, K)
    ws128 = ws128.reshape(N // 128, K // 128)
    w1, ws1 = q_blocks(w)
    deq_x = (qx.float().reshape(M, -1, 128) * sx.unsqueeze(-1)).reshape(M, K)
    ways = {
        "rows": lambda: torch._scaled_mm(rq, wr.t(), scale_a=rs, scale_b=wrs.t().contiguous(),
                                         out_dtype=torch.bfloat16),
        "blocks": lambda: F.scaled_mm(qx, wb.t(), sx, st.BlockWise1x128, ws128.t(),
                                      st.BlockWise128x128, output_dtype=torch.bfloat16),
    }
    for la, scale_b in (("(K/128, M) = sx.t()", sx.t()), ("(M, K/128) = sx", sx),
                        ("sx.t().contiguous()", sx.t().contiguous())):
        ways[f"blocks, transposed, x scales {la}"] = (
            lambda scale_b=scale_b: F.scaled_mm(w1, qx.t(), ws1, st.BlockWise1x128, scale_b,
                                                st.BlockWise1x128,
                                                output_dtype=torch.bfloat16).t())
    refs = {"rows": (rq.float() * rs) @ (wr.float() * wrs).t(),
            "blocks": deq_x @ (wb.float().reshape(N // 128, 128, K // 128, 128)
                               * ws128[:, None, :, None]).reshape(N, K).t()}
    deq_w1 = (w1.float().reshape(N, -1, 128) * ws1.unsqueeze(-1)).reshape(N, K)
    after = torch.compile(lambda out: F.layer_norm(out + resid, (N,), ln_w), dynamic=False)
    for name, gemm in ways.items():
        try:
            out = gemm()
        except Exception as exc:  # noqa: BLE001 - a refusal is the finding
            print(f"{name}: refused: {str(exc).splitlines()[0][:160]}")
            continue
        ref = refs.get(name, deq_x @ deq_w1.t())
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        print(f"{name}: out {tuple(out.shape)} strides {out.stride()}, error vs dequantized "
              f"{err:.2e}, GEMM {graph_ms(gemm):.3f} ms, GEMM + residual add + LayerNorm "
              f"{graph_ms(lambda gemm=gemm: after(gemm())):.3f} ms")


if __name__ == "__main__":
    main()
