"""Which of PyTorch's SDPA backends is fastest for a ViT's attention, per batch size, inside a
CUDA graph: the measurement that decides whether choosing a backend per budget at capture time
pays (it pays only if the fastest backend differs by shape, or differs from PyTorch's default).

For HF CLIP ViT-L/14 at 336 px (random weights, bf16, ``attn_implementation="sdpa"``), for each
batch size and each backend that accepts the shape (``torch.nn.attention.sdpa_kernel``): one CUDA
graph of the whole forward captured under that backend, its replay timed (median of 30), beside
the graph captured with PyTorch's own choice. One process, one device.

Usage: python benchmarks/attention_backends.py. JSON to benchmarks/results/ (and $OUT when set).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parent))
from diagnose import timed  # noqa: E402

BATCHES = (8, 24, 48)
BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def clip_l():
    from transformers import CLIPVisionConfig, CLIPVisionModel

    cfg = CLIPVisionConfig(image_size=336, patch_size=14, hidden_size=1024,
                           intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return CLIPVisionModel(cfg).to("cuda", torch.bfloat16).eval()


def graph_ms(model, x, backend):
    ctx = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                ref = model(pixel_values=x).last_hidden_state
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(pixel_values=x).last_hidden_state
    graph.replay()
    torch.cuda.synchronize()
    err = (out.float() - ref.float()).abs().max().item()
    ms = timed(graph.replay, reps=30)
    del graph, out
    return ms, err


def main():
    model = clip_l()
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "model": "HF CLIPVisionModel ViT-L/14 336 px, random weights, bf16, sdpa",
              "ms": {}, "errors": {}}
    print(f"{'batch':>6}" + "".join(f"{name:>12}" for name in BACKENDS))
    for batch in BATCHES:
        x = torch.randn(batch, 3, 336, 336, device="cuda", dtype=torch.bfloat16)
        row = {}
        for name, backend in BACKENDS.items():
            try:
                row[name], _ = graph_ms(model, x, backend)
            except Exception as exc:  # a backend that refuses the shape is a result
                row[name] = None
                result["errors"][f"{batch}/{name}"] = f"{type(exc).__name__}: {exc}"[:300]
            torch.cuda.empty_cache()
        result["ms"][batch] = row
        print(f"{batch:>6}" + "".join(f"{v:12.2f}" if v else f"{'n/a':>12}" for v in row.values()))
    name = f"attention_backends_clip_l14_336_{torch.cuda.get_device_name(0).replace(' ', '_')}"
    name += f"_torch{torch.__version__.split('+')[0]}.json"
    for folder in [Path("benchmarks/results"),
                   Path(os.environ["OUT"]) if os.environ.get("OUT") else None]:
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
