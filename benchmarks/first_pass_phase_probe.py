"""Where CLIP ViT-L/14-336's first pass spends its time, phase by phase, by wall-clock timers
wrapped around this package's functions and CUDA graph capture (no profiler under the compiled
call: Dynamo's frame hook breaks cProfile's stacks there,
``benchmarks/results/clip_l14_336_first_pass_cold_warm_profile_with_this_package_s_functions_*``).

The first pass is what ``benchmarks/first_pass_cache_probe.py`` runs: calls of 3 and then 48
images through ``torch.compile(model, backend="vitgraph")`` with the default options, so every
budget up to 48 is compiled and captured. Run it twice with the same ``TORCHINDUCTOR_CACHE_DIR``
and ``TRITON_CACHE_DIR``: the second run is the warm one.

Printed: the whole first pass; per timed function its calls and cumulative seconds (nested
ones inside their callers: the capture of a budget holds its warm-up, its choices timed and
its ``capture_end``); Dynamo's own phases (``torch._dynamo.utils.compile_times``).
``--profile N``: cProfile only while the backend compiles a graph (``VitGraphBackend.__call__``,
outside the compiled call, where Dynamo's hook is off) and the deferred inner compile, then its
N functions with the most cumulative time.

``--sdpa-without-cudnn``: PyTorch's cuDNN attention backend turned off for the process
(``torch.backends.cuda.enable_cudnn_sdp(False)``), to see what its per-shape plan builds cost the
warm-up runs. Each warm-up run's seconds are also printed by budget (its inputs' first size).

``--without-empty-cache``: ``torch.cuda.empty_cache`` made a no-op for the process (the warm-up
empties the allocator's cache before each budget to measure what it reserves), to see what
emptying and allocating again costs the warm-up runs.

``--profile-warm-up N``: cProfile over the warm-up runs after the first two (a synchronize
closing each, so GPU work left running shows there), then its N functions with the most own
and the most cumulative time: where the 0.07 to 0.13 s of host time per new shape goes.

``--patch-embedding conv|gemm``: that option (default: the package's), to see whether cuDNN's
first convolution at each new batch size is part of the warm-up runs' host time.

``--quantization fp8``: that option, to time FP8's first pass cold and warm. Every run also
prints what AOTAutograd's and Inductor's compile caches did (hits, misses, bypasses): a warm
run whose graphs bypass the cache traces and lowers them again.

Usage: python benchmarks/first_pass_phase_probe.py [--profile N] [--sdpa-without-cudnn]
[--without-empty-cache] [--patch-embedding conv|gemm] [--quantization fp8]
[--profile-warm-up N]
"""

from __future__ import annotations

import cProfile
import functools
import io
import pstats
import sys
import time
from collections import defaultdict

import torch
from first_pass_cache_probe import clip_l14_336_and_images

from vit_graph_backend import _compat
from vit_graph_backend.compile import backend
from vit_graph_backend.compile import batched
from vit_graph_backend.kernels import fused_linear
from vit_graph_backend.runtime import timing as gpu_timing
from vit_graph_backend.runtime import capture as graph_capture

_spent: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
_profiler: cProfile.Profile | None = None
_profiling = [0]
_by_budget: list[tuple[int | None, float]] = []


def _timed(owner: object, name: str, label: str, *, profile: bool = False) -> None:
    """Wrap ``owner.name`` so its calls add to ``_spent[label]`` (and run under the profiler)."""
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    kind = type(original) if isinstance(original, (staticmethod, classmethod)) else None
    function = original.__func__ if kind else original

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        if profile and _profiler is not None:
            _profiling[0] += 1
            if _profiling[0] == 1:
                _profiler.enable()
        try:
            return function(*args, **kwargs)
        finally:
            if profile and _profiler is not None:
                _profiling[0] -= 1
                if _profiling[0] == 0:
                    _profiler.disable()
            entry = _spent[label]
            entry[0] += 1
            entry[1] += time.perf_counter() - start

    setattr(owner, name, kind(wrapper) if kind else wrapper)


def main() -> None:
    global _profiler
    top = int(sys.argv[sys.argv.index("--profile") + 1]) if "--profile" in sys.argv else 0
    _profiler = cProfile.Profile() if top else None
    _timed(backend.VitGraphBackend, "__call__", "backend compile (call_user_compiler's)",
           profile=True)
    _timed(backend.VitGraphBackend, "_fuse_epilogues", "  linear + GELU rewrite")
    _timed(batched.BatchedGraphEncoder, "__init__", "  BatchedGraphEncoder()")
    _timed(_compat, "compile_fx_without_cudagraphs", "Inductor compile_fx (inner)", profile=True)
    _timed(graph_capture.BudgetGraphs, "capture", "budget captures (all parts)")
    _timed(graph_capture, "_warmup", "  warm-up runs")
    warmup = graph_capture._warmup
    warm_top = (int(sys.argv[sys.argv.index("--profile-warm-up") + 1])
                if "--profile-warm-up" in sys.argv else 0)
    warm_profiler = cProfile.Profile() if warm_top else None

    def by_budget(forward, static, *args):
        start = time.perf_counter()
        profiled = warm_profiler is not None and len(_by_budget) > 1  # after the first two
        if profiled:
            warm_profiler.enable()
        try:
            return warmup(forward, static, *args)
        finally:
            if profiled:
                torch.cuda.synchronize()  # the GPU's share shows as synchronize, not elsewhere
                warm_profiler.disable()
            budget = next(iter(static.values())).shape[0] if static else None
            _by_budget.append((budget, time.perf_counter() - start))

    graph_capture._warmup = by_budget
    if "--without-empty-cache" in sys.argv:
        torch.cuda.empty_cache = lambda: None
    if "--sdpa-without-cudnn" in sys.argv:
        torch.backends.cuda.enable_cudnn_sdp(False)
    _timed(fused_linear.LinearActChoices, "_time", "  fused shapes timed")
    _timed(gpu_timing, "graph_ms", "    timing graphs (graph_ms)")
    _timed(torch.cuda.CUDAGraph, "capture_begin", "  capture_begin (all graphs)")
    _timed(torch.cuda.CUDAGraph, "capture_end", "  capture_end (all graphs)")
    _timed(graph_capture, "make_launcher", "  instantiate (make_launcher)")
    model, x = clip_l14_336_and_images()
    options = {"max_budget": 48}
    if "--patch-embedding" in sys.argv:
        options["patch_embedding"] = sys.argv[sys.argv.index("--patch-embedding") + 1]
    if "--quantization" in sys.argv:
        options["quantization"] = sys.argv[sys.argv.index("--quantization") + 1]
    compiled = torch.compile(model, backend="vitgraph", options=options)
    start = time.perf_counter()
    with torch.no_grad():
        for batch in (3, 48):
            compiled(pixel_values=x[:batch])
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    report = backend.report()
    print(f"first pass {wall:.2f} s; Dynamo compiles {report['compiles']}; graphs captured "
          f"{report['graphs_captured']}")
    print("compile caches: " + ", ".join(f"{k} {v}" for k, v in
                                          sorted(_compat.compile_cache_counts().items()) if v))
    for label, (calls, seconds) in _spent.items():
        print(f"phase {label:<42} {calls:>5} calls {seconds:8.2f} s")
    print("warm-up by budget: " + ", ".join(f"{b}: {t * 1e3:.0f} ms" for b, t in _by_budget))
    times = torch._dynamo.utils.compile_times(repr="str", aggregate=True)
    keep = ("bytecode_tracing", "call_user_compiler", "build_guards", "compile_inner",
            "inductor_load", "load_by_key_path", "benchmark_all_configs", "aot_collect_metadata")
    for line in times.splitlines():
        if any(key in line for key in keep):
            print(f"dynamo {line.strip()}")
    if warm_profiler is not None:
        for order in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(warm_profiler, stream=out).sort_stats(order).print_stats(warm_top)
            print(f"== cProfile of the warm-up runs after the first two, by {order}")
            print("\n".join(line[:170] for line in out.getvalue().splitlines()
                            if line.strip() and not line.startswith("   Ordered")))
    if _profiler is not None:
        out = io.StringIO()
        pstats.Stats(_profiler, stream=out).sort_stats("cumulative").print_stats(top)
        print("== cProfile inside the backend's compile and the inner compile, cumulative")
        print("\n".join(line[:170] for line in out.getvalue().splitlines()
                        if line.strip() and not line.startswith("   Ordered")))


if __name__ == "__main__":
    main()
