"""What the Triton segment kernel's compiles cost where ``attention_kernel="timed"`` times it,
and whether compiling it less costs speed.

``attention_op.AttentionChoices`` times SDPA against the kernel in each of
``attention_op.TRITON_CONFIGS`` at every new attention shape; the first launch of a
configuration compiles it, and Triton compiles again for each new value of the kernel's slot
count (``SLOTS``: a power of two, at least 16 before, at least
``_segment_attention_kernel.MIN_SLOTS`` now) and each specialisation of its segment count (1,
or a multiple of 16, before). With cold caches, CLIP ViT-L/14-336's first pass with the option
spent 12.8 s timing attention shapes
(``benchmarks/results/attention_kernel_timed_vs_sdpa_clip_l14_336_interleaved_profile_*``).

One variant per process (the caller gives each a fresh ``TRITON_CACHE_DIR``); each launches
every configuration at CLIP-L's attention over the 1..48-image ladder (16 heads of 64, 577
tokens an image, the images as segments), each first launch timed (compile + launch + sync):

- ``before``: the kernel's source jitted as before (specialised on the segment count) and at
  least 16 slots;
- ``shipped``: the kernel as it ships;
- ``shipped-threads``: that kernel, its configurations built side by side first at each shape
  (``_segment_attention_kernel.precompile``), as ``attention_op`` does before timing one.

Each prints the compiles (Triton's in-memory cache entries) and the ladder's seconds.
``perf`` (no compile question): GPU ms per call, CUDA-graph timed, of the kernel as before and
as shipped, and shipped with 16 slots at least, at CLIP-L's attention of 1, 2, 8, 16 and 48
images and at a Qwen2.5-VL-3B full-attention budget of 4,096 rows (16 heads of 80) holding 2, 5
and 17 segments, with whether the outputs are bitwise equal.

Usage: TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/segment_attention_compile_probe.py VARIANT
"""

from __future__ import annotations

import sys
import time

import torch
import triton

from vit_graph_backend.kernels import _segment_attention_triton as K
from vit_graph_backend.attention_op import TRITON_CONFIGS
from vit_graph_backend.budgets import budget_ladder
from vit_graph_backend.runtime.timing import graph_ms

TOKENS, HEADS, DIM = 577, 16, 64  # CLIP ViT-L/14-336's attention
BEFORE_SLOTS = 16


def _before():
    return triton.jit(K._segment_attention.fn)


def _launch(kernel, q, offsets, config, least):
    out = torch.empty_like(q)
    grid, args, options = K._arguments(q, q, q, offsets, q.shape[-1] ** -0.5, out, config,
                                       None, least)
    kernel[grid](*args, **options)
    return out


def _compiles(kernel) -> int:
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def _clip(images: int, q_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.arange(0, images * TOKENS + 1, TOKENS, dtype=torch.int32, device="cuda")
    return q_all[:images * TOKENS], offsets


def ladder(variant: str) -> None:
    kernel = _before() if variant == "before" else K._segment_attention
    least = BEFORE_SLOTS if variant == "before" else K.MIN_SLOTS
    torch.manual_seed(0)
    q_all = torch.randn(48 * TOKENS, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start = time.perf_counter()
    firsts = {}
    for images in budget_ladder(1, 48, 2):
        q, offsets = _clip(images, q_all)
        if variant.endswith("threads"):
            K.precompile(q, q, q, offsets, DIM ** -0.5, TRITON_CONFIGS)
        for config in TRITON_CONFIGS:
            before = time.perf_counter()
            _launch(kernel, q, offsets, config, least)
            torch.cuda.synchronize()
            spent = time.perf_counter() - before
            if spent > 0.05:
                firsts[(images, config)] = spent
    total = time.perf_counter() - start
    print(f"{variant}: ladder {budget_ladder(1, 48, 2)} x {len(TRITON_CONFIGS)} configurations: "
          f"{total:.2f} s, {_compiles(kernel)} compiles")
    for (images, config), spent in firsts.items():
        print(f"    {images:3d} images, {'x'.join(map(str, config))}: {spent:.2f} s to the "
              "launch's return (compiles included)")


def perf() -> None:
    kernels = {"before": (_before(), BEFORE_SLOTS), "shipped": (K._segment_attention, K.MIN_SLOTS),
               "shipped, 16 slots": (K._segment_attention, BEFORE_SLOTS)}
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; bf16; GPU ms per call (graph of 10 calls, median of 5 "
          "replays), the best of 3 rounds alternating the kernels")
    torch.manual_seed(0)
    q_all = torch.randn(48 * TOKENS, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    cases = [(f"CLIP-L {n} images", *_clip(n, q_all), TRITON_CONFIGS[0]) for n in (1, 2, 8, 16)]
    cases += [(f"CLIP-L {n} images", *_clip(n, q_all), TRITON_CONFIGS[1]) for n in (8, 48)]
    qwen = torch.randn(4096, 16, 80, device="cuda", dtype=torch.bfloat16)
    for segments in (2, 5, 17):  # one long image, the rest short ones and the padding last
        lengths = [2730] + [64] * (segments - 2)
        lengths.append(4096 - sum(lengths))
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                               dtype=torch.int32, device="cuda")
        cases.append((f"Qwen2.5 4096 rows, {segments} segments", qwen, offsets, (128, 64, 4, 3)))
    for name, q, offsets, config in cases:
        times = {label: [] for label in kernels}
        for _ in range(3):
            for label, (kernel, least) in kernels.items():
                times[label].append(graph_ms(
                    lambda kernel=kernel, least=least: _launch(kernel, q, offsets, config, least),
                    10, 5))
        outs = [_launch(kernel, q, offsets, config, least) for kernel, least in kernels.values()]
        same = all(torch.equal(outs[0], out) for out in outs[1:])
        row = ", ".join(f"{label} {min(t):.4f}" for label, t in times.items())
        print(f"  {name:<32} {'x'.join(map(str, config)):<10} {row}; bitwise equal: {same}")


if __name__ == "__main__":
    variant = sys.argv[1]
    perf() if variant == "perf" else ladder(variant)
