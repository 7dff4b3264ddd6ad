"""What a CLIP ViT-L/14-336 first pass spends with a warm compile cache, ``epilogue_fusion`` on
and off: wall time of the first call (every budget compiled and captured), Inductor's FX graph
cache hits, misses and bypasses, and the time spent timing fused linear shapes and attention
shapes (``attention_op``).

Run it twice with the same ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR``: the second run
is the warm one. Also printed: Dynamo's own phase timings (``torch._dynamo.utils.compile_times``: tracing, the
backend's compile, Inductor's), the number of Dynamo compiles and the backend's capture seconds.
``--profile N``: the first pass under cProfile (which slows it), then the N
functions with the most cumulative time, to say where a warm first pass goes, then the N
functions of this package (``vit_graph_backend``) with the most, to say where its own share
(the backend's rewrites, warm-up runs, choices timed, captures) goes. Read its cumulative times
with care: Dynamo's frame hook breaks cProfile's call stack under the compiled call (one run
gave a function 13.1 s inside a 15 s profile whose only caller had 3.6 s:
``benchmarks/results/clip_l14_336_first_pass_cold_warm_profile_with_this_package_s_functions_*``).

``--warmup-iters N`` and ``--attention-kernel sdpa|timed``: those options (the defaults when not
given: the package's); the line of results names them.

Usage: python benchmarks/first_pass_cache_probe.py auto|off [--profile N] [--warmup-iters N]
[--attention-kernel sdpa|timed]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch
import transformers
from torch._dynamo.utils import counters

import vit_graph_backend
from vit_graph_backend import attention_op
from vit_graph_backend.kernels import fused_linear


def _time_spent(cls: type) -> list[float]:
    """Seconds ``cls._time`` (a per-shape timing of kernels) takes from here on, summed."""
    spent = [0.0]
    timer = cls._time

    def timed(self, *args):
        start = time.perf_counter()
        try:
            return timer(self, *args)
        finally:
            spent[0] += time.perf_counter() - start

    cls._time = timed
    return spent


def clip_l14_336_and_images() -> tuple[torch.nn.Module, torch.Tensor]:
    """The first pass's model (CLIP ViT-L/14-336, random weights, bf16, CUDA) and 48 images
    (``benchmarks/first_pass_phase_probe.py`` runs the same)."""
    cfg = transformers.CLIPVisionConfig(hidden_size=1024, intermediate_size=4096,
                                        num_hidden_layers=24, num_attention_heads=16,
                                        image_size=336, patch_size=14)
    torch.manual_seed(0)
    model = transformers.CLIPVisionModel(cfg).cuda().eval().to(torch.bfloat16)
    return model, torch.randn(48, 3, 336, 336, device="cuda", dtype=torch.bfloat16)


def main() -> None:
    mode = sys.argv[1]
    spent = _time_spent(fused_linear.LinearActChoices)
    attention_spent = _time_spent(attention_op.AttentionChoices)
    model, x = clip_l14_336_and_images()
    options = {"max_budget": 48, "epilogue_fusion": mode}
    if "--warmup-iters" in sys.argv:
        options["warmup_iters"] = int(sys.argv[sys.argv.index("--warmup-iters") + 1])
    if "--attention-kernel" in sys.argv:
        options["attention_kernel"] = sys.argv[sys.argv.index("--attention-kernel") + 1]
    warmups = options.get("warmup_iters", vit_graph_backend.VitGraphOptions().warmup_iters)
    attention = options.get("attention_kernel",
                            vit_graph_backend.VitGraphOptions().attention_kernel)
    compiled = torch.compile(model, backend="vitgraph", options=options)
    top = int(sys.argv[sys.argv.index("--profile") + 1]) if "--profile" in sys.argv else 0
    profiler = cProfile.Profile() if top else None
    start = time.perf_counter()
    with torch.no_grad():
        if profiler:
            profiler.enable()
        for batch in (3, 48):
            compiled(pixel_values=x[:batch])
        torch.cuda.synchronize()
        if profiler:
            profiler.disable()
    wall = time.perf_counter() - start
    inductor = {k: v for k, v in counters["inductor"].items() if "fxgraph" in k}
    print(f"epilogue_fusion={mode}, warmup_iters={warmups}, attention_kernel={attention}: first "
          f"pass {wall:.2f} s, of which timing fused shapes {spent[0]:.2f} s "
          f"({len(fused_linear.CHOICES.state['chosen'])} shapes), attention shapes "
          f"{attention_spent[0]:.2f} s ({len(attention_op.CHOICES.state['chosen'])} shapes); "
          f"Inductor FX graph cache {inductor}")
    report = vit_graph_backend.report()
    print(f"Dynamo compiles {report['compiles']}; graphs captured {report['graphs_captured']} in "
          f"{report['capture_seconds']:.2f} s (warm-up runs, choices timed and captures)")
    print(torch._dynamo.utils.compile_times(repr="str", aggregate=True))
    if profiler:
        for title, restrict in (("all functions", ()), ("this package", ("vit_graph_backend",))):
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(*restrict, top)
            print(f"== cProfile, {title}, by cumulative time")
            print("\n".join(line[:160] for line in out.getvalue().splitlines()
                            if line.strip() and not line.startswith("   Ordered")))


if __name__ == "__main__":
    main()
