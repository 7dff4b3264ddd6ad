"""Full attention over segments at the Qwen towers' head sizes: the Triton segment kernel
(``adapters/_segment_attention_kernel.py``: a head of 80 or 72 split into 64 + 16 columns)
against cuDNN's ragged kernel (what the packed graphs run), dense SDPA and flash varlen.

cuDNN runs heads of 80 and 72 at the cost of 128 (``attention_head_padding_*``): 365 to 386
TFLOP/s counted at head size 80. A kernel that tiles 64 + 16 does 80/128 of that tile work; it
pays if its tiles run at more than 0.63 of cuDNN's rate.

The cases named "vit ..." are the batched ViTs' attention (CLIP-L/14-336, ViT-B/16, SigLIP
so400m, DINOv2-L): images of one size as segments of one length, where "sdpa" takes q, k and v
as ``[B, heads, tokens, head]`` views, as HF's attention modules pass them; what
``attention_kernel="timed"`` (``attention_op.py``) chooses between.

Per case (segments of the packed sequence: one image, an image and its graph's padding, frames),
each kernel is timed from CUDA-graph replays (``gpu_timing.graph_ms``); the Triton kernel in
each of ``CONFIGS`` (block of rows, block of keys, warps, pipeline stages). ``err``: max abs
difference from flash varlen's output (bf16 inputs of unit variance). TFLOP/s counted at the
real head size over the real segments (4 * sum(len^2) * heads * head).

Usage: python benchmarks/segment_attention_kernel_probe.py [--configs all|best] [--cases TEXT]
[--config M,N,W,S[,R] ...] [--contiguous] [--once].
Text to stdout
and $OUT/segment_attention_kernel_probe.txt.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _bench_out import emit

from vit_graph_backend.kernels.cudnn_attention import RaggedAttention, cudnn_frontend_reason
from vit_graph_backend.runtime.timing import graph_ms

#: name -> (segment lengths, heads, head size); the last segment of "... in N" is padding
CASES = {
    "qwen2.5-vl-3b 4096": ([4096], 16, 80),
    "qwen2.5-vl-3b 16384": ([16384], 16, 80),
    "qwen2.5-vl-3b 12000 in 16384": ([12000, 4384], 16, 80),
    "qwen2.5-vl-3b 1024 in 1536": ([1024, 512], 16, 80),
    "qwen2.5-vl-3b 2730 in 4096": ([2730, 1366], 16, 80),
    "qwen2.5-vl-3b 16 frames of 1024": ([1024] * 16, 16, 80),
    "qwen2.5-vl-3b 64 frames of 256 in 16640": ([256] * 64 + [256], 16, 80),
    "qwen2.5-vl-3b 2 images in 4096": ([1600, 2304, 192], 16, 80),
    "qwen3-vl-8b 6724": ([6724], 16, 72),
    "qwen3-vl-8b 4900 in 7168": ([4900, 2268], 16, 72),
    # the batched ViTs' attention (images of one size: segments of one length)
    "vit clip-l14-336 b8": ([577] * 8, 16, 64),
    "vit clip-l14-336 b48": ([577] * 48, 16, 64),
    "vit vit-b16 b32": ([197] * 32, 12, 64),
    "vit siglip-so400m-384 b16": ([729] * 16, 16, 72),
    "vit dinov2-l14-518 b8": ([1370] * 8, 16, 64),
}

#: (block_m, block_n, warps, stages); the first is the wrapper's
CONFIGS = [(128, 64, 4, 3), (128, 64, 4, 4), (64, 64, 4, 3), (128, 32, 4, 4), (128, 64, 8, 4)]


def _flop(lengths: list[int], padded: bool, heads: int, head: int) -> int:
    real = lengths[:-1] if padded else lengths
    return 4 * sum(n * n for n in real) * heads * head


def _config(text: str) -> tuple:
    """``M,N,W,S[,R]`` as (block_m, block_n, warps, stages, registers or None)."""
    numbers = [int(p) for p in text.split(",")]
    return (*numbers[:4], numbers[4] if len(numbers) > 4 else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", choices=("all", "best"), default="all")
    parser.add_argument("--cases", default="", help="only the cases whose name holds this")
    parser.add_argument("--config", action="append", default=[], metavar="M,N,W,S[,R]",
                        help="time this Triton configuration instead of CONFIGS (block of rows, "
                        "block of keys, warps, stages, and optionally a cap on registers per "
                        "thread, Triton's maxnreg); repeatable")
    parser.add_argument("--once", action="store_true",
                        help="run each kernel once per case, untimed (for a profiler such as "
                        "Nsight Compute to attribute one launch of each)")
    parser.add_argument("--contiguous", action="store_true",
                        help="q, k, v as three contiguous tensors (as the capture-time timing "
                        "makes them) instead of views of one packed projection")
    args = parser.parse_args()
    from torch.nn.attention.varlen import varlen_attn

    from vit_graph_backend.kernels import _segment_attention_triton as seg

    dev = "cuda"
    ragged = RaggedAttention() if cudnn_frontend_reason() is None else None
    configs = [(*c, None) for c in (CONFIGS if args.configs == "all" else CONFIGS[:1])]
    if args.config:
        configs = [_config(c) for c in args.config]
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, cuDNN "
             f"{torch.backends.cudnn.version()}; bf16; ms per call from CUDA-graph replays; "
             "TFLOP/s at the real head size over the real segments",
             f"{'case':<34}{'kernel':<22}{'ms':>8}{'TFLOP/s':>9}{'err':>10}"]
    print("\n".join(lines), flush=True)
    for name, (lengths, heads, head) in CASES.items():
        if args.cases not in name:
            continue
        rows, longest = sum(lengths), max(lengths)
        gen = torch.Generator(device=dev).manual_seed(rows)
        # q, k, v as views of one packed projection, as the towers lay them out
        qkv = torch.randn(rows, 3, heads, head, device=dev, dtype=torch.bfloat16, generator=gen)
        q, k, v = (x.contiguous() if args.contiguous else x for x in qkv.unbind(1))
        offsets = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        offsets = offsets.to(dev)
        scale = head ** -0.5
        flop = _flop(lengths, " in " in name, heads, head)
        kernels = {"flash-varlen": lambda: varlen_attn(q, k, v, offsets, offsets, longest,
                                                       longest, scale=scale)}
        if ragged is not None:
            kernels["cudnn-ragged"] = lambda: ragged(q, k, v, offsets, longest, scale)
        if len(set(lengths)) == 1:  # [B, heads, T, head] views, as HF's attention passes them
            dense = [x.view(len(lengths), longest, heads, head).transpose(1, 2)
                     for x in (q, k, v)]
            kernels["sdpa"] = lambda: F.scaled_dot_product_attention(
                *dense, scale=scale).transpose(1, 2).reshape(rows, heads, head)
        for bm, bn, warps, stages, regs in configs:
            kernels[f"triton {bm}x{bn} w{warps} s{stages}{f' r{regs}' if regs else ''}"] = (
                lambda bm=bm, bn=bn, warps=warps, stages=stages, regs=regs: seg.attend(
                    q, k, v, offsets, scale, bm, bn, warps, stages, regs))
        ref = None
        with torch.no_grad():
            for kname, run in kernels.items():
                try:
                    got = run()
                    if got is None:
                        raise RuntimeError("refused")
                    ms = float("nan") if args.once else graph_ms(run)
                except Exception as exc:  # a config Triton cannot compile (shared memory)
                    lines.append(f"{name:<34}{kname:<22} failed: {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:70] if str(exc) else ''}")
                    print(lines[-1], flush=True)
                    continue
                got = got.float()
                ref = got if ref is None else ref
                err = (got - ref).abs().max().item()
                lines.append(f"{name:<34}{kname:<22}{ms:>8.3f}{flop / ms / 1e9:>9.0f}"
                             f"{err:>10.2e}")
                print(lines[-1], flush=True)
    emit(lines, "segment_attention_kernel_probe", echo=False)


if __name__ == "__main__":
    main()
