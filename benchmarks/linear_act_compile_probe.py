"""What the fused linear + activation kernel's Triton compiles cost in a cold first pass, and what
would cut them.

``fused_linear.LinearActChoices`` times every fused tile configuration (``FUSED_CONFIGS``) at each
new row count; the first call of a configuration compiles it, and Triton compiles again for each
new specialization of the kernel's integer arguments (a row count divisible by 16 or not). With
cold caches, CLIP ViT-L/14-336's first pass spends about 6 to 7 s there (of 46 to 51 s:
``benchmarks/results/clip_l14_336_first_pass_cold_*``).

One variant per process (the caller gives each a fresh ``TRITON_CACHE_DIR``), each configuration
launched at CLIP-L fc1's row counts over the 1..48-image ladder, each first launch timed (compile
+ launch + sync):

- ``specialized``: the kernel's source jitted as before ``_linear_act_kernels.py`` stopped
  specialising it on the row count;
- ``shipped``: the kernel as it ships (``do_not_specialize`` on the row count);
- ``shipped-threads``: that kernel, its configurations built side by side first
  (``_linear_act_kernels.precompile``), as ``fused_linear`` does before timing a shape.

Each prints the compiles (Triton's in-memory cache entries), the seconds to the first launch of
each configuration and the whole ladder's seconds. ``perf`` (no compile question): GPU ms per
call, CUDA-graph timed, of the specialised and the shipped kernel at 8, 16 and 48 images, and
whether their outputs are bitwise equal: the row count's specialisation is not worth a compile.

Usage: TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/linear_act_compile_probe.py VARIANT
"""

from __future__ import annotations

import sys
import time

import torch
import triton

from vit_graph_backend.kernels import _linear_act_triton as K
from vit_graph_backend.budgets import budget_ladder
from vit_graph_backend.kernels.fused_linear import FUSED_CONFIGS
from vit_graph_backend.runtime.timing import graph_ms

TOKENS, HIDDEN, WIDTH = 577, 1024, 4096  # CLIP ViT-L/14-336's fc1


def _specialized():
    return triton.jit(K._linear_act_kernel.fn)


def _launch(kernel, x, w, b, config):
    out, grid, args, options = K._arguments(x, w, b, "quick_gelu", config, True)
    kernel[grid](*args, **options)
    return out


def _compiles(kernel) -> int:
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def ladder(variant: str) -> None:
    kernel = _specialized() if variant == "specialized" else K._linear_act_kernel
    torch.manual_seed(0)
    w = torch.randn(WIDTH, HIDDEN, device="cuda", dtype=torch.bfloat16) / 32
    b = torch.randn(WIDTH, device="cuda", dtype=torch.bfloat16)
    x_all = torch.randn(48 * TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start = time.perf_counter()
    if variant.endswith("threads"):
        K.precompile(x_all[:TOKENS], w, b, "quick_gelu", FUSED_CONFIGS)
        print(f"{variant}: {len(FUSED_CONFIGS)} configurations compiled side by side in "
              f"{time.perf_counter() - start:.2f} s")
    firsts = {}
    for images in budget_ladder(1, 48, 2):
        x = x_all[:images * TOKENS]
        for config in FUSED_CONFIGS:
            before = time.perf_counter()
            _launch(kernel, x, w, b, config)
            torch.cuda.synchronize()
            spent = time.perf_counter() - before
            if spent > 0.05:
                firsts[(images, config)] = spent
    total = time.perf_counter() - start
    print(f"{variant}: ladder {budget_ladder(1, 48, 2)} x {len(FUSED_CONFIGS)} configurations: "
          f"{total:.2f} s, {_compiles(kernel)} compiles")
    for (images, config), spent in firsts.items():
        print(f"    {images:3d} images ({images * TOKENS} rows), {'x'.join(map(str, config))}: "
              f"{spent:.2f} s to the first launch")


def perf() -> None:
    kernels = {"specialized": _specialized(), "shipped": K._linear_act_kernel}
    torch.manual_seed(0)
    w = torch.randn(WIDTH, HIDDEN, device="cuda", dtype=torch.bfloat16) / 32
    b = torch.randn(WIDTH, device="cuda", dtype=torch.bfloat16)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; CLIP-L fc1 + quick GELU, bf16; GPU ms per call (graph of 10 "
          "calls, median of 5 replays), rounds alternating the kernels")
    for images in (8, 16, 48):
        x = torch.randn(images * TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
        for config in FUSED_CONFIGS[:1]:
            times = {name: [] for name in kernels}
            for _ in range(3):
                for name, kernel in kernels.items():
                    times[name].append(graph_ms(lambda kernel=kernel: _launch(kernel, x, w, b,
                                                                            config), 10, 5))
            row = ", ".join(f"{name} {min(t):.4f}" for name, t in times.items())
            print(f"  {images:3d} images ({images * TOKENS} rows) {'x'.join(map(str, config))}:"
                  f" {row}")
            same = torch.equal(_launch(kernels["specialized"], x, w, b, config),
                               _launch(kernels["shipped"], x, w, b, config))
            print(f"        outputs bitwise equal: {same}")


if __name__ == "__main__":
    variant = sys.argv[1]
    perf() if variant == "perf" else ladder(variant)
