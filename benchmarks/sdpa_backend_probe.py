"""Whether choosing an SDPA backend per budget would pay for the batched encoders: each of
PyTorch's SDPA backends (cuDNN, flash, memory-efficient, and PyTorch's own pick) timed on the
attention shapes of the ViTs we serve, at the batch sizes of their budgets, from CUDA-graph
replays (``gpu_timing.graph_ms``, as the package times its own choices).

The batched path leaves the backend to PyTorch's dispatcher inside the traced graph;
``attention_backends.py`` measured that at the model level for CLIP ViT-L/14-336 (the default,
cuDNN, was fastest at 8, 24 and 48 images). This probe widens that to ViT-B/16, SigLIP so400m
(head size 72), DINOv2 at 224 and 518 px, and batch 1 to 48: a per-budget choice pays only
where some backend beats the default by a margin at some budget.

Usage: python benchmarks/sdpa_backend_probe.py. Text to stdout and $OUT/sdpa_backend_probe.txt.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _bench_out import emit
from torch.nn.attention import SDPBackend, sdpa_kernel

from vit_graph_backend.runtime.timing import graph_ms

# name -> (heads, tokens, head size, batch sizes)
SHAPES = {
    "clip-l14-336": (16, 577, 64, (1, 8, 24, 48)),
    "vit-b16": (12, 197, 64, (1, 8, 32)),
    "siglip-so400m-384": (16, 729, 72, (1, 8, 16)),
    "dinov2-b14-224": (12, 257, 64, (1, 8, 32)),
    "dinov2-l14-518": (16, 1370, 64, (1, 4, 8)),
}
BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}


def time_backend(q, k, v, backend):
    def run():
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v)
    try:
        return graph_ms(run, calls=10, reps=10)
    except RuntimeError as exc:   # the backend does not take this shape
        return f"n/a ({str(exc).splitlines()[0][:40]})"


def main():
    lines = [f"# SDPA backends per attention shape, ms per call from CUDA-graph replays; "
             f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, bf16, "
             f"[B, heads, tokens, head] q/k/v as HF's ViTs pass them (transposed views)",
             f"{'shape':<28}" + "".join(f"{name:>12}" for name in BACKENDS) +
             f"{'best':>12}{'default/best':>14}"]
    for name, (heads, tokens, head, batches) in SHAPES.items():
        for batch in batches:
            gen = torch.Generator(device="cuda").manual_seed(batch)
            # [B, T, H, D] then transposed, as HF's attention modules hand them to SDPA
            q, k, v = (torch.randn(batch, tokens, heads, head, device="cuda",
                                   dtype=torch.bfloat16, generator=gen).transpose(1, 2)
                       for _ in range(3))
            ms = {label: time_backend(q, k, v, backend) for label, backend in BACKENDS.items()}
            timed = {label: t for label, t in ms.items() if isinstance(t, float)}
            best = min(timed, key=timed.__getitem__)
            cells = "".join(f"{t:12.4f}" if isinstance(t, float) else f"{'n/a':>12}"
                            for t in ms.values())
            lines.append(f"{f'{name} b{batch}':<28}{cells}{best:>12}"
                         f"{timed['default'] / timed[best]:14.2f}")
            print(lines[-1], flush=True)
            refused = {label: t for label, t in ms.items() if not isinstance(t, float)}
            if refused:
                lines.append(f"    refused: {refused}")
    emit(lines, "sdpa_backend_probe", echo=False)


if __name__ == "__main__":
    main()
