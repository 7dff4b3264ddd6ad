"""What FP8 buys one linear layer at CLIP ViT-L/14-336's shapes, before building the option.

Times, per shape: bf16 ``F.linear``; the FP8 GEMM alone (``torch._scaled_mm``, e4m3, row-wise
activation scales, per-output-channel weight scales, bf16 bias and output); and the whole FP8
linear (activation quantized per row at run time, then the GEMM), eager and under Inductor,
which can fuse the quantization into one pass. Error is against an fp32 linear.

    python benchmarks/fp8_linear_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def fp8_linear(x, wq, w_scale, bias, fast):
    xq, x_scale = quantize_rows(x)
    return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale, bias=bias,
                            out_dtype=torch.bfloat16, use_fast_accum=fast)


def time_ms(fn, iters=50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / iters)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    dev = torch.device("cuda")
    print("torch", torch.__version__, torch.cuda.get_device_name(0),
          "capability", torch.cuda.get_device_capability(0))
    print("F.scaled_mm public:", hasattr(F, "scaled_mm"),
          "ScalingType:", [n for n in dir(getattr(F, "ScalingType", object)) if n[0].isupper()])
    compiled = torch.compile(fp8_linear)
    rows = []
    for m in (8 * 577, 24 * 577, 48 * 577):
        for k, n in ((1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
            b = torch.randn(n, device=dev, dtype=torch.bfloat16) * 0.1
            w_amax = w.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
            w_scale = (w_amax / E4M3_MAX).t().contiguous()          # [1, N]
            wq = (w.float() / w_scale.t()).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
            xq, x_scale = quantize_rows(x)
            ref = F.linear(x.float(), w.float(), b.float())
            row = {"m": m, "k": k, "n": n}
            row["bf16_ms"] = time_ms(lambda: F.linear(x, w, b))
            for fast in (False, True):
                tag = "fast" if fast else "exact"
                row[f"gemm_{tag}_ms"] = time_ms(lambda: torch._scaled_mm(
                    xq, wq.t(), scale_a=x_scale, scale_b=w_scale, bias=b,
                    out_dtype=torch.bfloat16, use_fast_accum=fast))
                row[f"eager_{tag}_ms"] = time_ms(lambda: fp8_linear(x, wq, w_scale, b, fast))
                row[f"inductor_{tag}_ms"] = time_ms(lambda: compiled(x, wq, w_scale, b, fast))
                out = fp8_linear(x, wq, w_scale, b, fast).float()
                row[f"rel_err_{tag}"] = ((out - ref).abs().max() / ref.abs().max()).item()
            row["rel_err_bf16"] = ((F.linear(x, w, b).float() - ref).abs().max()
                                   / ref.abs().max()).item()
            rows.append(row)
            print(" ".join(f"{key}={val:.4g}" if isinstance(val, float) else f"{key}={val}"
                           for key, val in row.items()), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                       "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
