"""Per family: the served tower against HF eager at a real checkpoint's vision shape.

For each packed family ``serve()`` serves (random weights, bf16, one GPU), the tower alone:
1 and 4 document-sized images (about 1288 x 980 px each) and a 16-frame 448 px video (8 temporal
patches; the GLM towers take it as 8 one-frame items, as their models send it). Per workload: HF
eager's and the served tower's median ms (CUDA-synchronized calls after a warm-up; the served
tower's first call captures its graphs), the speed-up, the largest difference from HF relative to
HF's largest magnitude, and the served tower's fraction of the bf16 matmul peak (FLOPs counted by
``FlopCounterMode`` on HF's forward; the peak measured in this run).

The shapes are each family's vision config defaults (the reference checkpoint's, per
transformers), except where ``tests/hf_models.py: REAL_VISION`` says otherwise.

``--ttft``: the whole model instead (``hf_models.at_real_shape``: the family's default text
model, the checkpoint's where that fits in 20B parameters, else a subset of its layers holding
every kind of layer), eager against
``serve_vision_``: time to first token at 4 document images and at the video, the tower's share
of eager's, and whether 8 greedy tokens equal eager's.

Usage: python benchmarks/families.py [--families a,b] [--reps 10] [--profile | --ttft]. Text to
stdout and to ``$OUT/families.txt`` (``families_ttft.txt``) when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _bench_out import emit  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
import hf_models  # noqa: E402  (the families' shapes and prompts, shared with the GPU tests)

from vit_graph_backend import serve  # noqa: E402
from vit_graph_backend.bench.roofline import count_stream_flops, matmul_peak_tflops  # noqa: E402
from vit_graph_backend.bench.timing import CallTimer  # noqa: E402

#: the families measured (their towers' classes; GLM-4.6V, ColQwen2 and Cosmos3-Omni build
#: towers of these classes at the same shapes)
FAMILIES = ("qwen2", "qwen2_5", "qwen2_5_omni", "exaone4_5", "qwen3", "qwen3_moe",
            "qwen3_omni_moe", "cohere_compass", "qwen3_5", "qwen3_5_moe", "qwen4_exp",
            "ernie4_5_vl_moe", "glm4v", "glm4v_moe", "glm_ocr", "glm5_next", "glm_image")
#: towers whose HF forward takes one frame a grid row (their models split a video into frames;
#: GLM-Image takes images only: its "video" is 16 separate images)
ONE_FRAME = ("glm4v", "glm4v_moe", "glm_image")


def build(family: str) -> tuple[torch.nn.Module, str]:
    return hf_models.real_tower(family, device="cuda", dtype=torch.bfloat16)


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


def median_ms(fn, reps: int, warmup: int = 2) -> float:
    timer = CallTimer("cuda")
    for _ in range(warmup):
        fn()
    return statistics.median(timer.wall(fn)[1] * 1e3 for _ in range(reps))


def each_family(families: str, run_one) -> list[str]:
    """``run_one(family)``'s lines for each family; a family's failure is a line, the others
    still run, and each family's memory is freed before the next."""
    lines: list[str] = []
    for family in families.split(","):
        try:
            lines += run_one(family)
        except Exception as exc:
            lines.append(f"{family:<16}FAILED: {type(exc).__name__}: {str(exc)[:300]}")
            print(lines[-1], flush=True)
        finally:
            gc.collect()
            torch.cuda.empty_cache()
    return lines


def _tower_ms(tower: torch.nn.Module, call) -> float:
    """GPU time of ``tower``'s forward inside one ``call`` of its model (CUDA events around it)."""
    events: list[torch.cuda.Event] = []
    hooks = [tower.register_forward_pre_hook(lambda *_: events.append(_recorded())),
             tower.register_forward_hook(lambda *_: events.append(_recorded()))]
    try:
        call()
        torch.cuda.synchronize()
    finally:
        for hook in hooks:
            hook.remove()
    return sum(a.elapsed_time(b) for a, b in zip(events[::2], events[1::2]))


def _recorded() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def ttft_rows(family: str, reps: int) -> list[str]:
    """Time to first token of ``family``'s model (the checkpoint's text model where it fits,
    see ``hf_models.at_real_shape``), eager against ``serve_vision_``: 4 document images and a
    16-frame video, in separate prompts; the tower's share of eager's; 8 greedy tokens each."""
    import vit_graph_backend as vg

    model, note = hf_models.at_real_shape(family, text="default", device="cuda")
    tower = model.get_submodule(hf_models.tower_name(family, model))
    grids = hf_models.real_grids(model)
    prompts = {"4 images": hf_models.packed_prompt(family, model, 0, "cuda", torch.bfloat16,
                                                   video=False, grids=grids)}
    if family != "glm_image":
        prompts["video"] = hf_models.packed_prompt(family, model, 1, "cuda", torch.bfloat16,
                                                   images=False, grids=grids)
    found: dict[str, dict] = {label: {} for label in prompts}

    def measure(mode: str) -> None:
        with torch.inference_mode():
            for label, prompt in prompts.items():
                row = found[label]
                first = lambda: model.generate(**prompt, max_new_tokens=1, do_sample=False)  # noqa: E731
                row[mode] = median_ms(first, reps, warmup=1)
                row[mode + " vision"] = statistics.median(_tower_ms(tower, first)
                                                          for _ in range(reps))
                out = model.generate(**prompt, max_new_tokens=8, do_sample=False,
                                     output_scores=True, return_dict_in_generate=True)
                row[mode + " tokens"] = out.sequences[0, -8:].tolist()
                row[mode + " scores"] = [s[0].float() for s in out.scores]

    measure("eager")
    vg.serve_vision_(model)
    measure("served")
    lines = [f"{family:<16}{note}"]
    for label, row in found.items():
        ref, got = row["eager tokens"], row["served tokens"]
        parted = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        if parted is None:
            tokens = "8/8 equal"
        else:
            scores = row["eager scores"][parted]
            gap = (scores[ref[parted]] - scores[got[parted]]).item()
            tokens = f"part at {parted} (eager's gap {gap:.2g})"
        lines.append(f"{'':<16}{label:<10}{row['eager']:>10.1f}{row['eager vision']:>9.1f}"
                     f"{row['eager vision'] / row['eager']:>7.0%}{row['served']:>11.1f}"
                     f"{row['served vision']:>9.1f}{row['eager'] / row['served']:>8.2f}x  {tokens}")
    print("\n".join(lines), flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--profile", action="store_true",
                        help="add each family's kernel time by class at 4 images (profiler)")
    parser.add_argument("--ttft", action="store_true",
                        help="time to first token of the whole model instead of the tower")
    parser.add_argument("--name", default=None, help="the $OUT file's name (default: families, "
                        "families_ttft with --ttft)")
    args = parser.parse_args()
    if args.ttft:
        return main_ttft(args)
    peak = matmul_peak_tflops("cuda", torch.bfloat16)
    lines = [f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, bf16, random "
             f"weights; bf16 matmul peak measured {peak:.0f} TFLOP/s",
             f"{'family':<16}{'shape of':<28}{'workload':<10}{'HF ms':>9}{'served ms':>11}"
             f"{'speed-up':>10}{'rel err':>9}{'of peak':>9}"]
    print("\n".join(lines), flush=True)
    def tower_rows(family: str) -> list[str]:
        rows = []
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
                rows.append(f"{family:<16}{name[:27]:<28}{label:<10}{hf:>9.2f}{ms:>11.2f}"
                            f"{hf / ms:>9.2f}x{err:>9.1e}{frac:>9.2f}")
                print(rows[-1], flush=True)
            if args.profile:
                pixels, grid = workloads(tower, family)["4 images"]
                rows += kernel_shares(lambda: served(pixels, grid))
        report = served.report()
        rows.append(f"{'':<16}graphs {report['graphs_captured']} (budgets "
                    f"{report['captured_budgets']}), graph replays "
                    f"{report['stats']['graph_replays']}, eager batches "
                    f"{report['stats']['eager_batches']}")
        print(rows[-1], flush=True)
        return rows

    lines += each_family(args.families, tower_rows)
    emit(lines, args.name or "families", echo=False)


def main_ttft(args: argparse.Namespace) -> None:
    lines = [f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, bf16, random "
             f"weights; ttft = generate(max_new_tokens=1), median of {args.reps}; vision = the "
             f"tower's GPU time inside eager's; tokens: 8 greedy tokens equal to eager's, or where they part and the gap between the two tokens' scores in eager's step",
             f"{'family':<16}{'prompt':<10}{'eager ms':>10}{'vision':>9}{'share':>7}"
             f"{'served ms':>11}{'vision':>9}{'gain':>9}  tokens"]
    print("\n".join(lines), flush=True)
    lines += each_family(args.families, lambda family: ttft_rows(family, args.reps))
    emit(lines, args.name or "families_ttft", echo=False)


if __name__ == "__main__":
    main()
