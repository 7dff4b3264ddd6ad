"""Error of ``quantization="fp8"`` against an fp32 reference, beside bf16's, on HF CLIP
ViT-L/14-336 (random weights, the bench's ``clip-l14-336`` shape).

Each bf16 mode runs a copy of the fp32 model; the error is the max abs difference over the max
abs value of the fp32 output (the metric of ``verify_tolerance``), for ``last_hidden_state`` and
``pooler_output``, over a few batches.

    python benchmarks/fp8_accuracy.py [--batch 8] [--calls 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
import transformers


def _clip_l14_336() -> torch.nn.Module:
    config = transformers.CLIPVisionConfig(hidden_size=1024, intermediate_size=4096,
                                           num_hidden_layers=24, num_attention_heads=16,
                                           image_size=336, patch_size=14)
    torch.manual_seed(0)
    return transformers.CLIPVisionModel(config).cuda().eval()


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    ref_model = _clip_l14_336()
    bf16 = copy.deepcopy(ref_model).to(torch.bfloat16)
    budgets = {"budgets": [args.batch]}
    modes = {
        "eager bf16": bf16,
        "vitgraph-inductor bf16": torch.compile(
            bf16, backend="vitgraph", options={**budgets, "inner_compiler": "inductor"}),
        "vitgraph-fp8": torch.compile(
            copy.deepcopy(bf16), backend="vitgraph",
            options={**budgets, "inner_compiler": "inductor", "quantization": "fp8"}),
    }
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(args.batch, 3, 336, 336, generator=generator).cuda()
              for _ in range(args.calls)]
    refs = [ref_model(pixel_values=x) for x in inputs]
    rows = []
    for name, fn in modes.items():
        hidden, pooled = [], []
        for x, ref in zip(inputs, refs):
            out = fn(pixel_values=x.bfloat16())
            hidden.append(_rel(out.last_hidden_state, ref.last_hidden_state))
            pooled.append(_rel(out.pooler_output, ref.pooler_output))
        rows.append({"mode": name, "last_hidden_state": max(hidden), "pooler_output": max(pooled)})
        print(f"{name:24s} max relative error vs fp32: last_hidden_state {max(hidden):.3g}, "
              f"pooler_output {max(pooled):.3g}", flush=True)
        torch.compiler.reset()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                       "model": "HF CLIPVisionModel ViT-L/14-336, random weights (seed 0)",
                       "batch": args.batch, "calls": args.calls,
                       "metric": "max |out - fp32| / max |fp32|", "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
