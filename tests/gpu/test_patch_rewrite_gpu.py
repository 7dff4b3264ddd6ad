"""``patch_embedding="gemm"`` on CUDA: CLIP ViT-L/14-336's patch embedding as the GEMM against a
float32 convolution in bf16 (sides multiples of the patch and not), and HF CLIP and timm ViT
through ``torch.compile(backend="vitgraph")``, replayed from CUDA graphs at several batch sizes,
against eager with the option on and off, each Inductor and eager inside the graphs."""

from __future__ import annotations

import pytest
import torch

import vit_graph_backend
from vit_graph_backend.compile.patch_rewrite import patch_embeddings_as_gemm

pytestmark = pytest.mark.gpu

DEV, DT = "cuda", torch.bfloat16


class _Embed(torch.nn.Module):
    def __init__(self, width=1024, patch=14):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, width, patch, patch)

    def forward(self, x):
        return self.conv(x).flatten(2).transpose(1, 2)


@pytest.mark.parametrize("side", [336, 343])  # 24 patches a side; 24 and 7 pixels dropped
def test_clip_l_patch_embedding_as_gemm_within_bf16_of_fp32(side):
    torch.manual_seed(0)
    model = _Embed().to(DEV).eval()
    x = torch.randn(6, 3, side, side, device=DEV)
    ref = model(x)
    model.to(DT)
    counts = []

    def backend(gm, example_inputs):
        counts.append(patch_embeddings_as_gemm(gm, example_inputs))
        return gm

    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x.to(DT)).float()
    assert counts == [1]
    # a K of 588 products in fp32, the inputs and weights rounded to bf16 (2**-8 each)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2
    assert out.shape == ref.shape == (6, (side // 14) ** 2, 1024)


def _clip():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CLIPVisionConfig(hidden_size=256, intermediate_size=1024,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        image_size=224, patch_size=14)
    torch.manual_seed(0)
    return transformers.CLIPVisionModel(cfg).to(DEV, DT).eval()


def _timm():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model("vit_small_patch16_224", pretrained=False, depth=2,
                             num_classes=0).to(DEV, DT).eval()


def _primary(out):
    return out if isinstance(out, torch.Tensor) else out.last_hidden_state


@pytest.mark.parametrize("inner", ["auto", "eager"])
@pytest.mark.parametrize("patch_embedding", ["gemm", "conv"])
@pytest.mark.parametrize("make", [_clip, _timm], ids=["hf_clip", "timm_vit"])
def test_vits_through_vitgraph_match_eager(make, patch_embedding, inner):
    model = make()
    torch.compiler.reset()
    compiled = torch.compile(model, backend="vitgraph", options={
        "budgets": [2, 6], "patch_embedding": patch_embedding, "inner_compiler": inner})
    with torch.no_grad():
        for batch in (2, 5, 6, 9):
            x = torch.randn(batch, 3, 224, 224, device=DEV, dtype=DT)
            ref = _primary(model(x)).float()
            out = _primary(compiled(x)).float()
            rel = ((out - ref).abs().max() / ref.abs().max()).item()
            assert rel < 3e-2, (batch, rel)
    stats = vit_graph_backend.report()["stats"]
    assert stats["graph_replays"] >= 4, stats  # 5 and 6 images, then 9 as 6 + 3
    torch.compiler.reset()
