"""Host time of SDPA's first call at a new batch size, cuDNN's backend against flash, at CLIP
ViT-L/14-336's attention shape (16 heads of 64 over 577 tokens, bf16).

Question: a warm CLIP-L first pass spends 0.07 to 0.13 s of host time in each new budget's
warm-up run (``benchmarks/results/clip_l14_336_first_pass_cold_warm_patch_gemm_vs_conv_*``), and a
cProfile of those runs (``first_pass_phase_probe.py --profile-warm-up``) put 1.1 of 2.0 s in one
ATen op called once per layer. Is it cuDNN building its attention plan for each new shape?

Printed per backend and batch (in the order a first pass meets them, cuDNN twice: the second
round shows its plans cached): host ms of the first, the second and the mean of calls 3 to 24
(one per layer), each call synchronized.

Usage: python benchmarks/sdpa_first_call_probe.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BATCHES = (48, 40, 32, 7, 3)


def host_ms(backend: SDPBackend, batch: int) -> list[float]:
    qs = [torch.randn(batch, 16, 577, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    times = []
    with sdpa_kernel([backend]):
        for i in range(24):
            q = qs[i % 3]
            torch.cuda.synchronize()
            start = time.perf_counter()
            F.scaled_dot_product_attention(q, q, q)
            times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return times


def main() -> None:
    print("torch", torch.__version__, torch.cuda.get_device_name(0), "cuDNN",
          torch.backends.cudnn.version())
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                    SDPBackend.CUDNN_ATTENTION):
        for batch in BATCHES:
            ts = host_ms(backend, batch)
            print(f"{backend.name:16s} batch {batch:2d}: host ms first {ts[0]:7.2f}, second "
                  f"{ts[1]:6.2f}, calls 3-24 mean {sum(ts[2:]) / 22:6.3f}, sum of 24 {sum(ts):7.2f}")


if __name__ == "__main__":
    main()
