"""Where the GPU time of one CLIP ViT-L/14-336 call goes, bf16 against ``quantization="fp8"``.

``--modes`` picks among ``bf16`` (the defaults), ``bf16-epilogue-off``
(``epilogue_fusion="off"``), ``bf16-timed-attention``
(``attention_kernel="timed"``), ``bf16-patch-conv`` (``patch_embedding="conv"``) and ``fp8``. Each mode
replays the vitgraph CUDA graph of one budget (Inductor inside); ``torch.profiler``
records the kernels of the replays, and they are summed by kind (GEMM, attention, Inductor's
fused Triton kernels, other), with the largest kernels listed.

    python benchmarks/clip_kernel_profile.py [--batch 48] [--modes bf16,fp8] [--top 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import copy
import json

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

MODES = {"bf16": {}, "bf16-epilogue-off": {"epilogue_fusion": "off"},
         "bf16-timed-attention": {"attention_kernel": "timed"}, "fp8": {"quantization": "fp8"},
         "bf16-patch-conv": {"patch_embedding": "conv"}}


def _kind(name: str) -> str:
    low = name.lower()
    if "linear_act_kernel" in low:  # fused_linear's GEMM with its activation
        return "gemm"
    if "activation_kernel" in low:  # fused_linear's activation after cuBLAS
        return "triton (fused elementwise, norms, quantization)"
    if any(k in low for k in ("flash", "fmha", "attention", "attn")):
        return "attention"
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")):
        return "gemm"
    if low.startswith("triton"):
        return "triton (fused elementwise, norms, quantization)"
    return "other"


def _profile(fn, x, calls: int, top: int) -> dict:
    for _ in range(3):
        fn(pixel_values=x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(pixel_values=x)
        torch.cuda.synchronize()
    kinds: dict[str, float] = collections.Counter()
    kernels: dict[str, float] = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            kinds[_kind(event.name)] += event.device_time / 1e3 / calls
            kernels[event.name[:90]] += event.device_time / 1e3 / calls
    return {"ms_per_call_by_kind": dict(kinds),
            "total_ms_per_call": sum(kinds.values()),
            "top_kernels_ms_per_call": dict(kernels.most_common(top))}


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--modes", default="bf16-epilogue-off,bf16,fp8",
                        help=f"comma-separated, of {sorted(MODES)}")
    parser.add_argument("--top", type=int, default=8, help="largest kernels listed per mode")
    parser.add_argument("--json")
    args = parser.parse_args()
    config = transformers.CLIPVisionConfig(hidden_size=1024, intermediate_size=4096,
                                           num_hidden_layers=24, num_attention_heads=16,
                                           image_size=336, patch_size=14)
    torch.manual_seed(0)
    model = transformers.CLIPVisionModel(config).cuda().eval().to(torch.bfloat16)
    x = torch.randn(args.batch, 3, 336, 336, device="cuda", dtype=torch.bfloat16)
    base = {"budgets": [args.batch], "inner_compiler": "inductor"}
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
              "batch": args.batch, "modes": {}}
    for name in args.modes.split(","):
        extra = MODES[name]
        fn = torch.compile(copy.deepcopy(model), backend="vitgraph", options={**base, **extra})
        result["modes"][name] = got = _profile(fn, x, args.calls, args.top)
        print(f"== {name}: {got['total_ms_per_call']:.2f} ms of kernels per call")
        for kind, ms in sorted(got["ms_per_call_by_kind"].items(), key=lambda kv: -kv[1]):
            print(f"   {kind:50s} {ms:7.2f} ms")
        for kernel, ms in got["top_kernels_ms_per_call"].items():
            print(f"     {ms:7.2f} ms  {kernel}")
        torch.compiler.reset()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
