"""Per family: the served tower against HF eager at a real checkpoint's vision shape.

For each packed family ``serve()`` serves (random weights, bf16, one GPU), the tower alone:
1 and 4 document-sized images (about 1288 x 980 px each) and a 16-frame 448 px video (8 temporal
patches; the GLM towers take it as 8 one-frame items, as their models send it). Per workload: HF
eager's and the served tower's median ms (CUDA-synchronized calls after a warm-up; the served
tower's first call captures its graphs), the speed-up, the largest difference from HF relative to
HF's largest magnitude, and the served tower's fraction of the bf16 matmul peak (FLOPs counted by
``FlopCounterMode`` on HF's forward; the peak measured in this run).

The shapes are each family's vision config defaults (the reference checkpoint's, per
transformers), except where noted in ``SHAPES``. Usage: python benchmarks/families.py
[--families a,b] [--reps 10] [--profile]. Text to stdout and to ``$OUT/families.txt`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _bench_out import emit  # noqa: E402

from vit_graph_backend import serve  # noqa: E402
from vit_graph_backend.bench.roofline import count_stream_flops, matmul_peak_tflops  # noqa: E402
from vit_graph_backend.bench.timing import CallTimer  # noqa: E402

_QWEN25_7B = dict(hidden_size=1280, intermediate_size=3420, out_hidden_size=3584, num_heads=16,
                  depth=32)
#: family -> (config class, tower class, the checkpoint it stands for, config overrides)
SHAPES = {
    "qwen2_vl": ("Qwen2VLVisionConfig", "Qwen2VisionTransformerPretrainedModel",
                 "Qwen2-VL-7B", {}),
    "qwen2_5_vl": ("Qwen2_5_VLVisionConfig", "Qwen2_5_VisionTransformerPretrainedModel",
                   "Qwen2.5-VL-3B", dict(hidden_size=1280, out_hidden_size=2048)),
    "qwen2_5_omni": ("Qwen2_5OmniVisionEncoderConfig", "Qwen2_5OmniVisionEncoder",
                     "Qwen2.5-Omni-7B (Qwen2.5-VL-7B's tower)", _QWEN25_7B),
    "exaone4_5": ("Exaone4_5_VisionConfig", "Exaone4_5_VisionModel",
                  "EXAONE-4.5 (Qwen2.5-VL-7B's tower, 8 key-value heads)",
                  dict(_QWEN25_7B, num_key_value_heads=8)),
    "qwen3_vl": ("Qwen3VLVisionConfig", "Qwen3VLVisionModel", "Qwen3-VL-8B",
                 dict(out_hidden_size=4096)),
    "qwen3_vl_moe": ("Qwen3VLMoeVisionConfig", "Qwen3VLMoeVisionModel", "Qwen3-VL-30B-A3B", {}),
    "qwen3_omni_moe": ("Qwen3OmniMoeVisionEncoderConfig", "Qwen3OmniMoeVisionEncoder",
                       "Qwen3-Omni-30B-A3B", {}),
    "cohere_compass": ("CohereCompassVisionConfig", "CohereCompassVisionModel",
                       "Cohere Compass", {}),
    "qwen3_5": ("Qwen3_5VisionConfig", "Qwen3_5VisionModel", "Qwen3.5", {}),
    "qwen3_5_moe": ("Qwen3_5MoeVisionConfig", "Qwen3_5MoeVisionModel", "Qwen3.5-MoE", {}),
    "qwen4_exp": ("Qwen4ExpVisionConfig", "Qwen4ExpVisionModel", "Qwen4-Exp", {}),
    "ernie4_5_vl_moe": ("Ernie4_5_VLMoeVisionConfig",
                        "Ernie4_5_VLMoeVisionTransformerPretrainedModel",
                        "ERNIE-4.5-VL-28B-A3B", {}),
    "glm4v": ("Glm4vVisionConfig", "Glm4vVisionModel", "GLM-4.1V-9B", {}),
    "glm4v_moe": ("Glm4vMoeVisionConfig", "Glm4vMoeVisionModel", "GLM-4.5V", {}),
    "glm_ocr": ("GlmOcrVisionConfig", "GlmOcrVisionModel", "GLM-OCR", {}),
    "glm5_next": ("Glm5NextVisionConfig", "Glm5NextVisionModel", "GLM-5.3-Flash", {}),
    "glm_image": ("GlmImageVisionConfig", "GlmImageVisionModel", "GLM-Image", {}),
}
#: towers whose HF forward takes one frame a grid row (their models split a video into frames;
#: GLM-Image takes images only: its "video" is 16 separate images)
ONE_FRAME = ("glm4v", "glm4v_moe", "glm_image")


def build(family: str) -> tuple[torch.nn.Module, str]:
    config, model, name, overrides = SHAPES[family]
    cfg_mod = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cfg = getattr(cfg_mod, config)(**overrides)
    with torch.device("cuda"):
        tower = getattr(mod, model)(cfg)
    return tower.to(torch.bfloat16).eval(), name


def workloads(tower: torch.nn.Module, family: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    cfg = tower.config
    patch, merge = int(cfg.patch_size), int(cfg.spatial_merge_size)
    temporal = int(getattr(cfg, "temporal_patch_size", None) or 1)
    dim = int(cfg.in_channels) * temporal * patch * patch
    step = patch * merge

    def grid(h_px: int, w_px: int, t: int = 1) -> list[int]:
        return [t, h_px // step * merge, w_px // step * merge]

    doc = grid(980, 1288)
    frames = 16 // temporal
    video = [grid(448, 448)] * frames if family in ONE_FRAME else [grid(448, 448, frames)]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def call(grids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        return pixels, torch.tensor(grids, device="cuda")

    return {"1 image": call([doc]), "4 images": call([doc] * 4), "video": call(video)}


def first(out):
    if hasattr(out, "pooler_output"):
        return out.pooler_output if out.pooler_output is not None else out.last_hidden_state
    return out if isinstance(out, torch.Tensor) else out[0]


def count_flops(tower: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> int:
    """FLOPs of HF's forward; through HF's eager attention where the counter cannot read the
    SDPA call (grouped-query attention: the same FLOPs with key and value heads repeated)."""
    try:
        return count_stream_flops(lambda p, g: tower(p, grid_thw=g), [(pixels, grid)])
    except AssertionError:
        kept = tower.config._attn_implementation
        tower.config._attn_implementation = "eager"
        try:
            return count_stream_flops(lambda p, g: tower(p, grid_thw=g), [(pixels, grid)])
        finally:
            tower.config._attn_implementation = kept


#: kernel name fragments -> the class a profile table groups them in
KINDS = (("attention", ("attention", "flash", "fmha", "sdpa", "cudnn", "_segment", "_short")),
         ("GEMM", ("gemm", "nvjet", "cutlass", "sm90_xmma", "_linear_act", "matmul")),
         ("other", ("",)))


def kernel_shares(fn) -> list[str]:
    """The GPU time of one call by kernel class, and its five longest kernels (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) or 1.0
    shares: dict[str, float] = {}
    for e in events:
        kind = next(k for k, parts in KINDS if any(p in e.key.lower() for p in parts))
        shares[kind] = shares.get(kind, 0.0) + e.self_device_time_total
    lines = ["  4 images, GPU time by kernel class: " + ", ".join(
        f"{k} {v / total:.0%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]))
        + f" (of {total / 1e3:.1f} ms)"]
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:5]:
        lines.append(f"    {e.self_device_time_total / total:>5.1%}  {e.count:>4}x  {e.key[:90]}")
    print("\n".join(lines), flush=True)
    return lines


def median_ms(fn, reps: int) -> float:
    timer = CallTimer("cuda")
    for _ in range(2):
        fn()
    return statistics.median(timer.wall(fn)[1] * 1e3 for _ in range(reps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(SHAPES))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--profile", action="store_true",
                        help="add each family's kernel time by class at 4 images (profiler)")
    args = parser.parse_args()
    peak = matmul_peak_tflops("cuda", torch.bfloat16)
    lines = [f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, bf16, random "
             f"weights; bf16 matmul peak measured {peak:.0f} TFLOP/s",
             f"{'family':<16}{'shape of':<28}{'workload':<10}{'HF ms':>9}{'served ms':>11}"
             f"{'speed-up':>10}{'rel err':>9}{'of peak':>9}"]
    print("\n".join(lines), flush=True)
    for family in args.families.split(","):
        try:
            tower, name = build(family)
            served = serve(tower, max_frames_per_batch=32)
            with torch.inference_mode():
                for label, (pixels, grid) in workloads(tower, family).items():
                    # the ERNIE tower's output is per patch; the adapter's is its merged view
                    ref = first(tower(pixels, grid_thw=grid)).float()
                    got = served(pixels, grid)
                    got = (got if isinstance(got, torch.Tensor) else got[0]).float()
                    err = ((got.reshape(ref.shape) - ref).abs().max()
                           / ref.abs().max().clamp(min=1)).item()
                    hf = median_ms(lambda: tower(pixels, grid_thw=grid), args.reps)
                    ms = median_ms(lambda: served(pixels, grid), args.reps)
                    flops = count_flops(tower, pixels, grid)
                    frac = flops / (ms * 1e-3) / (peak * 1e12)
                    line = (f"{family:<16}{name[:27]:<28}{label:<10}{hf:>9.2f}{ms:>11.2f}"
                            f"{hf / ms:>9.2f}x{err:>9.1e}{frac:>9.2f}")
                    lines.append(line)
                    print(line, flush=True)
                if args.profile:
                    pixels, grid = workloads(tower, family)["4 images"]
                    lines += kernel_shares(lambda: served(pixels, grid))
            report = served.report()
            lines.append(f"{'':<16}graphs {report['graphs_captured']} (budgets "
                         f"{report['captured_budgets']}), graph replays "
                         f"{report['stats']['graph_replays']}, eager batches "
                         f"{report['stats']['eager_batches']}")
            print(lines[-1], flush=True)
        except Exception as exc:  # one family's failure is reported, the others still run
            lines.append(f"{family:<16}FAILED: {type(exc).__name__}: {str(exc)[:300]}")
            print(lines[-1], flush=True)
        finally:
            tower = served = None
            gc.collect()
            torch.cuda.empty_cache()
    emit(lines, "families", echo=False)


if __name__ == "__main__":
    main()
