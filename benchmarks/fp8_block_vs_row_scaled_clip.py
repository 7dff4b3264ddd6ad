"""``quantization="fp8"`` with fc2 block-scaled (the default on Hopper) against all layers
row-scaled (as before), beside the bf16 default and eager, on HF CLIP ViT-L/14-336 (random
weights), in one process.

Each mode is its own ``torch.compile`` of a copy of one bf16 model, on budgets of exactly the
batches timed. ``fp8 rows`` is compiled with ``fp8_linear.scaling_for`` made to answer
``"rows"`` (and with ``warmup_iters=2``, see below). Per batch, the modes are timed in turn, round after round (10 calls issued back to
back, then a sync; ms per call), and the median round is kept, so the machine's drift falls on
all modes alike. Then per fp8 mode: its kernels at the largest batch by kind under
``torch.profiler`` (``clip_kernel_profile._profile``), and the max relative error of
``last_hidden_state`` and ``pooler_output`` against the fp32 model, beside bf16's.

    python benchmarks/fp8_block_vs_row_scaled_clip.py [--batches 8,24,48] [--rounds 7]
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
import transformers
from clip_kernel_profile import _profile

from vit_graph_backend import fp8_linear


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def _ms_per_call(fn, x, calls: int = 10) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn(pixel_values=x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="8,24,48")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    config = transformers.CLIPVisionConfig(hidden_size=1024, intermediate_size=4096,
                                           num_hidden_layers=24, num_attention_heads=16,
                                           image_size=336, patch_size=14)
    torch.manual_seed(0)
    ref_model = transformers.CLIPVisionModel(config).cuda().eval()
    model = copy.deepcopy(ref_model).to(torch.bfloat16)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
          f", batches {batches}, rounds {args.rounds}")
    budgets = {"budgets": batches}
    modes = {
        "eager": model,
        "bf16 default": torch.compile(copy.deepcopy(model), backend="vitgraph", options=budgets),
        # warmup_iters=2 (capture only) keeps its options unlike fp8 blocks': Dynamo shares a
        # compiled frame between torch.compile calls whose backend options are equal, so the
        # two would otherwise run one mode's graphs (seen in the first run of this probe)
        "fp8 rows": torch.compile(copy.deepcopy(model), backend="vitgraph",
                                  options={**budgets, "quantization": "fp8", "warmup_iters": 2}),
        "fp8 blocks": torch.compile(copy.deepcopy(model), backend="vitgraph",
                                    options={**budgets, "quantization": "fp8"}),
    }
    real = fp8_linear.scaling_for
    inputs = {b: torch.randn(b, 3, 336, 336, device="cuda", dtype=torch.bfloat16)
              for b in batches}
    for name, fn in modes.items():  # compile and capture each mode's graphs
        fp8_linear.scaling_for = (lambda shape, device: "rows") if name == "fp8 rows" else real
        for b in batches + batches:
            fn(pixel_values=inputs[b])
    fp8_linear.scaling_for = real
    torch.cuda.synchronize()
    table = {}
    for b in batches:
        rounds = {name: [] for name in modes}
        for _ in range(args.rounds):
            for name, fn in modes.items():
                rounds[name].append(_ms_per_call(fn, inputs[b]))
        table[b] = {name: statistics.median(times) for name, times in rounds.items()}
        for name, ms in table[b].items():
            print(f"batch {b:>3} {name:<14} {ms:8.2f} ms a call, {table[b]['eager'] / ms:5.2f}x "
                  f"eager  (rounds {min(rounds[name]):.2f}..{max(rounds[name]):.2f})")
    largest = batches[-1]
    for name in ("bf16 default", "fp8 rows", "fp8 blocks"):
        got = _profile(modes[name], inputs[largest], 5)
        kinds = ", ".join(f"{kind.split(' ')[0]} {ms:.2f}" for kind, ms in
                          sorted(got["ms_per_call_by_kind"].items(), key=lambda kv: -kv[1]))
        print(f"kernels at batch {largest}, {name}: {got['total_ms_per_call']:.2f} ms ({kinds})")
        for kernel, ms in list(got["top_kernels_ms_per_call"].items())[:5]:
            print(f"    {ms:7.2f} ms  {kernel}")
    x = torch.randn(batches[0], 3, 336, 336, device="cuda", generator=torch.Generator(
        device="cuda").manual_seed(1))
    ref = ref_model(pixel_values=x)
    for name, fn in modes.items():
        out = fn(pixel_values=x.bfloat16())
        print(f"error vs fp32 at batch {batches[0]}, {name}: last_hidden_state "
              f"{_rel(out.last_hidden_state, ref.last_hidden_state):.4f}, pooler_output "
              f"{_rel(out.pooler_output, ref.pooler_output):.4f}")


if __name__ == "__main__":
    main()
