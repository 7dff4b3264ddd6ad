"""Time to first token of a VLM, eager against ``serve_vision_``, in one run.

Random weights in bfloat16 on one CUDA GPU, the published shapes of Qwen2.5-VL-3B (vision: 32
blocks of 1280, window attention; text: 36 layers of 2048) or Qwen3-VL-4B (vision: 24 blocks of
1024, deepstack; text: 36 layers of 2560), ``--family``. Prompts: 64 text tokens plus 1 to 4
document/photo sized images (up to 1288 px) or one short video (8 frames of 448 px). Per prompt:

- ``ttft``: wall time of ``generate(max_new_tokens=1)`` (prefill plus one token), median of 5
  after 2 warm-up calls, synchronized;
- ``vision``: wall time of the tower's call alone on the same pixels (eager), and its share of
  the eager ttft, which bounds what serving the tower can save.

Eager runs first, then ``serve_vision_`` (graph capture in the warm-up), on the same model and
inputs; greedy first tokens are compared. Writes JSON and a table (``--out`` prefix).
Usage (CUDA machine, repo root): python benchmarks/hf_ttft.py
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import time

import torch

VIDEO_FRAMES, TEMPORAL, MERGE = 8, 2, 2
IMG, VID, VS, VE = 151655, 151656, 151652, 151653
_MROPE = {"rope_type": "default", "rope_theta": 1000000.0}

#: family -> published shapes (random weights), patch size, images (height, width) in pixels,
#: the video's frame side, and whether the processor writes a segment per temporal patch
FAMILIES = {
    "qwen2_5_vl_3b": dict(
        config="Qwen2_5_VLConfig", model="Qwen2_5_VLForConditionalGeneration", patch=14,
        images=[(1288, 980), (980, 1288), (1148, 868), (672, 896)], video_side=448,
        segment_per_frame=False,
        text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                  num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                  max_position_embeddings=32768,
                  rope_parameters={**_MROPE, "mrope_section": [16, 24, 24]}),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                    out_hidden_size=2048, patch_size=14, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31], spatial_merge_size=MERGE,
                    temporal_patch_size=TEMPORAL)),
    "qwen3_vl_4b": dict(
        config="Qwen3VLConfig", model="Qwen3VLForConditionalGeneration", patch=16,
        images=[(1280, 960), (960, 1280), (1152, 864), (672, 896)], video_side=448,
        segment_per_frame=True,
        text=dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                  num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, max_position_embeddings=32768,
                  rope_parameters={**_MROPE, "rope_theta": 5000000.0,
                                   "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
        vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                    out_hidden_size=2560, patch_size=16, num_position_embeddings=2304,
                    deepstack_visual_indexes=[5, 11, 17], spatial_merge_size=MERGE,
                    temporal_patch_size=TEMPORAL)),
}


def build(family: str, device: str) -> torch.nn.Module:
    import transformers as tr

    spec = FAMILIES[family]
    config = getattr(tr, spec["config"])(
        text_config=spec["text"], vision_config=spec["vision"], image_token_id=IMG,
        video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
    with torch.device(device):
        model = getattr(tr, spec["model"])(config)
    return model.to(torch.bfloat16).eval()


def prompt(family: str, model: torch.nn.Module, images: int, video: bool, device: str) -> dict:
    spec = FAMILIES[family]
    patch = spec["patch"]
    g = torch.Generator().manual_seed(images + 10 * video)
    ids, grids, pixels = list(range(100, 132)), [], 0
    if video:
        side = spec["video_side"] // patch
        grids.append([VIDEO_FRAMES // TEMPORAL, side, side])
    else:
        grids += [[1, h // patch, w // patch] for h, w in spec["images"][:images]]
    token = VID if video else IMG
    for t, h, w in grids:
        if video and spec["segment_per_frame"]:
            for frame in range(t):   # "<t seconds>" text, then one segment per temporal patch
                ids += [300 + frame, VS] + [token] * (h * w // MERGE ** 2) + [VE]
        else:
            ids += [VS] + [token] * (t * h * w // MERGE ** 2) + [VE]
        pixels += t * h * w
    ids += list(range(200, 232))
    input_ids = torch.tensor([ids], device=device)
    values = torch.randn(pixels, 3 * TEMPORAL * patch * patch, generator=g).to(device,
                                                                               torch.bfloat16)
    grid = torch.tensor(grids, device=device)
    key = "video" if video else "image"
    inputs = {"input_ids": input_ids, f"pixel_values{'_videos' if video else ''}": values,
              f"{key}_grid_thw": grid}
    if "mm_token_type_ids" in inspect.signature(type(model).forward).parameters:
        inputs["mm_token_type_ids"] = ((input_ids == IMG).long() + 2 * (input_ids == VID).long())
    return inputs


def timed(fn, warmup: int = 2, repeat: int = 5) -> tuple[float, object]:
    out = None
    for _ in range(warmup):
        out = fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, out


def main() -> None:
    import vit_graph_backend as vg

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen2_5_vl_3b")
    parser.add_argument("--out", default=None, help="path prefix of the .txt and .json written "
                        "(default: $OUT/<family>_hf_ttft_<GPU>_torch<version>, else the "
                        "working directory)")
    args = parser.parse_args()
    if args.out is None:
        gpu = torch.cuda.get_device_name(0).replace("NVIDIA ", "").split()[0]
        args.out = os.path.join(os.environ.get("OUT", "."), f"{args.family}_hf_ttft_{gpu}_torch"
                                f"{torch.__version__.split('+')[0]}")
    device = "cuda"
    model = build(args.family, device)
    cases = [(n, False) for n in (1, 2, 3, 4)] + [(0, True)]
    prompts = {case: prompt(args.family, model, *case, device) for case in cases}
    rows: dict = {}

    def run_all(mode: str) -> None:
        for case, inputs in prompts.items():
            name = f"video {VIDEO_FRAMES}x{FAMILIES[args.family]['video_side']}" if case[1] \
                else f"{case[0]} image(s)"
            with torch.no_grad():
                ttft, tokens = timed(lambda: model.generate(**inputs, max_new_tokens=1,
                                                            do_sample=False))
                pixel_key = "pixel_values_videos" if case[1] else "pixel_values"
                grid_key = "video_grid_thw" if case[1] else "image_grid_thw"
                vision, _ = timed(lambda: model.model.visual(inputs[pixel_key],
                                                             grid_thw=inputs[grid_key]))
            row = rows.setdefault(name, {"vision_tokens": int(
                (inputs[grid_key].prod(-1) // MERGE ** 2).sum())})
            row[mode] = {"ttft_ms": round(ttft, 2), "vision_ms": round(vision, 2),
                         "first_token": tokens[0, -1].item()}

    run_all("eager")
    vg.serve_vision_(model)
    run_all("served")
    report = vg.hf.served_towers(model)["model.visual"].report()
    lines = [f"{args.family}-shaped, random weights, bf16, {torch.cuda.get_device_name(0)}, "
             f"torch {torch.__version__}; ttft = generate(max_new_tokens=1), median of 5",
             f"{'prompt':14} {'vision tok':>10} {'eager ttft':>11} {'vision share':>12} "
             f"{'served ttft':>12} {'gain':>6} {'same token':>10}"]
    for name, row in rows.items():
        eager, served = row["eager"], row["served"]
        row["gain"] = round(eager["ttft_ms"] / served["ttft_ms"], 3)
        row["vision_share"] = round(eager["vision_ms"] / eager["ttft_ms"], 3)
        lines.append(f"{name:14} {row['vision_tokens']:>10} {eager['ttft_ms']:>9.1f}ms "
                     f"{row['vision_share']:>12.0%} {served['ttft_ms']:>10.1f}ms "
                     f"{row['gain']:>5.2f}x {str(eager['first_token'] == served['first_token']):>10}")
    lines.append(f"served tower: {report['graphs_captured']} graphs, "
                 f"{report['graph_memory_bytes'] / 2**20:.0f} MiB, captured in "
                 f"{report['capture_seconds']} s; stats {report['stats']}")
    text = "\n".join(lines)
    print(text)
    with open(args.out + ".txt", "w") as f:
        f.write(text + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump({"family": args.family, "rows": rows, "report": report,
                   "torch": torch.__version__,
                   "device": torch.cuda.get_device_name(0)}, f, indent=1)


if __name__ == "__main__":
    main()
