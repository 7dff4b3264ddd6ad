"""Does an item's output depend on what it is served with? Measured, per mode, on a CUDA GPU.

Batched: CLIP ViT-L/14-336's vision tower (random weights, bf16). Row 0 of a seeded batch of 32
images is encoded alone and as the first row of batches of 2 to 32, in a shuffled order; the
table gives, per mode, how many of those differ from the row encoded alone and from the row in
the batch of 2 (the batch of 1 is Dynamo's own static graph), bit for bit, and the largest
relative difference. Packed: the Qwen2.5-VL-3B-shaped tower; one image of 32 x 32 patches alone
and packed with one to three others of other sizes, the same counts.

Every mode also prints a digest of all its outputs: run the script twice (two processes) to see
whether a mode gives the same bits from one process to the next.

Usage: python benchmarks/batch_invariance.py [--modes eager,vitgraph,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
from pathlib import Path

import torch

import vit_graph_backend

BATCHES = (2, 3, 5, 8, 13, 24, 32)
#: batched modes: torch.compile options (None: eager PyTorch)
BATCHED_MODES = {
    "eager": None,
    "vitgraph": {},
    "vitgraph-eager-kernels": {"inner_compiler": "eager", "epilogue_fusion": "off"},
    "vitgraph-batch-invariant": {"batch_invariant": True},
}
PACKED_MODES = {"hf-eager": None, "vitgraph": {}, "vitgraph-batch-invariant":
                {"batch_invariant": True}}


def clip_l():
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    cfg = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                           num_attention_heads=16, image_size=336, patch_size=14,
                           projection_dim=768)
    return CLIPVisionModel(cfg).cuda().to(torch.bfloat16).eval()


def qwen_tower():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel)

    cfg = Qwen2_5_VLVisionConfig(depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420,
                                 out_hidden_size=2048, patch_size=14, spatial_merge_size=2,
                                 window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
    torch.manual_seed(0)
    return Qwen2_5_VisionTransformerPretrainedModel(cfg).cuda().to(torch.bfloat16).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6))


def _summary(alone: torch.Tensor, rows: dict, digest: hashlib._Hash) -> dict:
    first = rows[min(rows)]
    for out in rows.values():
        digest.update(out.float().cpu().numpy().tobytes())
    return {"differ_from_alone": sum(not torch.equal(o, alone) for o in rows.values()),
            "differ_from_first_batch": sum(not torch.equal(o, first) for o in rows.values()),
            "of": len(rows),
            "max_rel_vs_alone": max(_rel(o, alone) for o in rows.values()),
            "digest": digest.hexdigest()[:16]}


def batched(modes: list[str]) -> dict:
    model = clip_l()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(32, 3, 336, 336, device="cuda", dtype=torch.bfloat16, generator=gen)
    order = list(BATCHES)
    random.Random(0).shuffle(order)
    results = {}
    for mode in modes:
        options = BATCHED_MODES[mode]
        torch.compiler.reset()
        fn = model if options is None else torch.compile(model, backend="vitgraph",
                                                         options=options or None)
        with torch.inference_mode():
            for _ in range(2):   # first pass: compiles and captures; the second is measured
                alone = fn(pixel_values=x[:1]).last_hidden_state[0].clone()
                rows = {b: fn(pixel_values=x[:b]).last_hidden_state[0].clone() for b in order}
        results[mode] = _summary(alone, rows, hashlib.sha256(alone.float().cpu().numpy()))
        print(f"batched {mode:26s} {results[mode]}", flush=True)
    return results


def packed(modes: list[str]) -> dict:
    tower = qwen_tower()
    gen = torch.Generator(device="cuda").manual_seed(1)
    sides = [(32, 32), (16, 24), (40, 20), (12, 12)]
    pixels = [torch.randn(h * w, 1176, device="cuda", dtype=torch.bfloat16, generator=gen)
              for h, w in sides]
    packings = [[0], [0, 1], [1, 0], [0, 2], [3, 0, 1], [2, 3, 0], [0, 1, 2, 3]]
    results = {}
    for mode in modes:
        options = PACKED_MODES[mode]
        served = None if options is None else vit_graph_backend.serve(tower, **options)
        rows = {}
        with torch.inference_mode():
            for _ in range(2):
                for k, items in enumerate(packings):
                    pv = torch.cat([pixels[i] for i in items])
                    grid = [[1, *sides[i]] for i in items]
                    out = (tower(pv, torch.tensor(grid, device="cuda")).pooler_output
                           if served is None else served(pv, grid))
                    start = sum(sides[i][0] * sides[i][1] // 4 for i in items[:items.index(0)])
                    rows[k] = out[start:start + 256].clone()
        alone = rows.pop(0)
        results[mode] = _summary(alone, rows, hashlib.sha256(alone.float().cpu().numpy()))
        print(f"packed  {mode:26s} {results[mode]}", flush=True)
        if served is not None:
            served.manager.clear()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="", help="comma-separated modes (default: all)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    wanted = [m for m in args.modes.split(",") if m]
    doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "batched": batched([m for m in BATCHED_MODES if not wanted or m in wanted]),
           "packed": packed([m for m in PACKED_MODES if not wanted or m in wanted])}
    text = json.dumps(doc, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    elif os.environ.get("OUT"):
        Path(os.environ["OUT"], "batch_invariance.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
