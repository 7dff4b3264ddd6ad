"""The ViTs' patch embedding (a convolution whose kernel equals its stride) as cuDNN runs it
against the same product as one GEMM over the patches, at the shapes of the bench's models.

Question: at CLIP ViT-L/14-336 with 48 images the convolution took 0.87 to 0.91 ms of a 37.2 ms
graph (``benchmarks/results/clip_l14_336_batch48_kernel_time_by_kind_*``) for 33 GFLOP, about
40 TFLOP/s. As a GEMM over the patches (27,648 x 588 x 1,024) it should take well under 0.2 ms
with the patches' copy. And each warm-up run of a new budget takes 60 to 220 ms of host time
(``benchmarks/results/clip_l14_336_first_pass_warm_up_runs_by_budget_*``): is cuDNN's first
convolution at a new shape part of that?

Printed, per model shape and batch: GPU ms per call from CUDA graph replays
(``gpu_timing.graph_ms``) of, each compiled by Inductor as the graphs run it,
``conv`` (``F.conv2d``, then ``flatten(2).transpose(1, 2)`` as CLIP does), ``gemm`` (the patches
gathered by a reshape and permute, one ``addmm``), ``gemm_k8`` (``gemm`` with the patch length
zero-padded to a multiple of 8, the row alignment cuBLAS's fast kernels want); and each one's
relative error against a float32 convolution. Then the host seconds of the first and second
eager call at each new batch size of CLIP-L's 1-to-48 ladder, largest first, for ``conv`` and
``gemm`` (the ladder's order in a first pass).

Usage: python benchmarks/patch_embedding_probe.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from vit_graph_backend.runtime.timing import graph_ms

#: (name, image side, patch side, width): CLIP ViT-L/14-336, ViT-B/16, SigLIP so400m/14-384.
SHAPES = (("clip-l14-336", 336, 14, 1024), ("vit-b16", 224, 16, 768),
          ("siglip-so400m14-384", 384, 14, 1152))
LADDER = (48, 40, 32, 28, 24, 20, 16, 14, 12, 10, 8, 7, 6, 5, 4, 3, 2, 1)


def conv(x, w, b):
    return F.conv2d(x, w, b, stride=w.shape[-1]).flatten(2).transpose(1, 2)


def gemm(x, w, b, k_pad: int = 0):
    n, c, h, wide = x.shape
    p = w.shape[-1]
    gh, gw = h // p, wide // p
    x = x[:, :, :gh * p, :gw * p]  # the remainder dropped, as the convolution drops it
    patches = (x.reshape(n, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5)
               .reshape(n * gh * gw, c * p * p))
    weight = w.reshape(w.shape[0], -1)
    if k_pad:
        patches = F.pad(patches, (0, k_pad))
        weight = F.pad(weight, (0, k_pad))
    return torch.addmm(b, patches, weight.t()).view(n, gh * gw, -1)


def gemm_k8(x, w, b):
    k = w[0].numel()
    return gemm(x, w, b, -k % 8)


def first_calls(fn, w, b, side: int) -> list[tuple[int, float, float]]:
    rows = []
    for n in LADDER:
        x = torch.randn(n, 3, side, side, device="cuda", dtype=torch.bfloat16)
        times = []
        for _ in range(2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn(x, w, b)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        rows.append((n, *times))
    return rows


def main() -> None:
    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name(0)} | torch {torch.__version__} | cuDNN "
          f"{torch.backends.cudnn.version()} | bf16")
    name, side, p, width = SHAPES[0]
    w = torch.randn(width, 3, p, p, device=dev, dtype=torch.bfloat16) * 0.05
    b = torch.randn(width, device=dev, dtype=torch.bfloat16) * 0.05
    print(f"\n== first and second eager call at each new batch size, {name}, ladder order (host s)")
    for label, fn in (("conv", conv), ("gemm", gemm)):
        rows = first_calls(fn, w, b, side)
        first = sum(r[1] for r in rows[1:])
        print(f"{label:5s} " + " ".join(f"{n}:{f * 1e3:.1f}/{s * 1e3:.1f}" for n, f, s in rows)
              + f" | ms first/second; sum of the first calls after the first size {first:.3f} s")

    print("\n== GPU ms per call (graph replays), Inductor-compiled; rel. error vs fp32 conv")
    print(f"{'model':22s} {'batch':>5s} {'conv':>8s} {'gemm':>8s} {'gemm_k8':>8s}   "
          f"{'err conv':>9s} {'err gemm':>9s} {'err k8':>9s}")
    # one compile per function and shape: past Dynamo's default limit of 8
    torch._dynamo.config.recompile_limit = 64
    compiled = {f.__name__: torch.compile(f, dynamic=False) for f in (conv, gemm, gemm_k8)}
    for name, side, p, width in SHAPES:
        w = torch.randn(width, 3, p, p, device=dev, dtype=torch.bfloat16) * 0.05
        b = torch.randn(width, device=dev, dtype=torch.bfloat16) * 0.05
        for n in (1, 8, 24, 48):
            x = torch.randn(n, 3, side, side, device=dev, dtype=torch.bfloat16)
            ref = conv(x.float(), w.float(), b.float())
            ms, err = [], []
            for label, fn in compiled.items():
                out = fn(x, w, b)
                err.append(((out.float() - ref).norm() / ref.norm()).item())
                ms.append(graph_ms(lambda fn=fn, x=x, w=w, b=b: fn(x, w, b), calls=10, reps=7))
            print(f"{name:22s} {n:5d} " + " ".join(f"{m:8.4f}" for m in ms) + "   "
                  + " ".join(f"{e:9.2e}" for e in err))


if __name__ == "__main__":
    main()
