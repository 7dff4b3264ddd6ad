"""Where a packed call's GPU time goes with cuDNN segment attention against flash varlen.

The Qwen2.5-VL-3B-shaped tower on one image of 1,024 / 4,096 / 16,384 patches, served with the
defaults (full attention through cuDNN when ``nvidia-cudnn-frontend`` is installed, window
layers through flash varlen) and with ``attention="varlen"``, each also with
``max_items_per_graph=1``; each call replayed from its graph and profiled with
``torch.profiler`` over 5 calls after a warm-up. Per mode: kernel launches and kernel ms per
call, summed by kind (``clip_kernel_profile._kind``), the attention split into full and window layers,
and the top kernels.

Usage: python benchmarks/cudnn_attention_profile.py [--sides 32,128]. Text to stdout and
$OUT/cudnn_attention_profile.txt when $OUT is set.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _bench_out import emit  # noqa: E402
from clip_kernel_profile import _kind  # noqa: E402
from packed_kernel_profile import kernel_events  # noqa: E402
from qwen_stream import tower  # noqa: E402

from vit_graph_backend import serve  # noqa: E402


def profile_call(fn, calls: int = 5) -> tuple[int, dict[str, float], dict[str, float], list]:
    """Kernel launches per call, ms per call by kind and of the top kernels, and each attention
    launch's ms in launch order."""
    events = kernel_events(fn, calls)
    kinds: collections.Counter = collections.Counter()
    kernels: collections.Counter = collections.Counter()
    for name, ms in events:
        kinds[_kind(name)] += ms / calls
        kernels[name[:90]] += ms / calls
    attention = [ms for name, ms in events if _kind(name) == "attention"]
    return len(events) // calls, dict(kinds), dict(kernels.most_common(4)), attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sides", default="32,64,128")
    args = parser.parse_args()
    hf = tower()
    full_layers = set(hf.config.fullatt_block_indexes)
    modes = {"varlen": {"attention": "varlen"}, "default": {},
             "varlen, 1 item/graph": {"attention": "varlen", "max_items_per_graph": 1},
             "default, 1 item/graph": {"max_items_per_graph": 1}}
    served = {name: serve(hf, **kwargs) for name, kwargs in modes.items()}
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; Qwen2.5-VL-3B-"
             "shaped tower, bf16; attention ms per call split into the full-attention layers "
             f"{sorted(full_layers)} and the window layers; default segments: "
             f"{served['default'].encoder.attention_state['segments']}"]
    with torch.inference_mode():
        for side in (int(s) for s in args.sides.split(",")):
            pv = torch.randn(side * side, 1176, device="cuda", dtype=torch.bfloat16)
            for name in modes:
                launches, kinds, top, attention = profile_call(
                    lambda s=served[name]: s(pv, [[1, side, side]]))
                per_call = len(attention) // 5
                full = sum(ms for i, ms in enumerate(attention) if i % per_call in full_layers) / 5
                window = sum(attention) / 5 - full
                lines.append(f"{side * side} patches, {name}: {launches} kernels, "
                             f"{sum(kinds.values()):.2f} ms per call; attention full {full:.2f} + "
                             f"window {window:.2f}; " + ", ".join(
                                 f"{k.split(' ')[0]} {v:.2f}" for k, v in
                                 sorted(kinds.items(), key=lambda kv: -kv[1])))
                lines += [f"      {ms:7.3f} ms  {k}" for k, ms in top.items()]
    emit(lines, "cudnn_attention_profile")


if __name__ == "__main__":
    main()
