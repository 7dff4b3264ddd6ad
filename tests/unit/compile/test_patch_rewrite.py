"""``patch_embedding="gemm"`` on CPU: which ``torch.conv2d`` nodes of a Dynamo graph the rewrite
takes (a stride equal to the kernel, no padding, dilation or groups) and which it leaves, that a
rewritten graph computes what the convolution did, with a batch axis Dynamo made symbolic too,
and that real ViTs compiled with the option equal eager. The same on a GPU, in CUDA graphs:
``tests/gpu/test_patch_rewrite_gpu.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from compile_caches import cache_outcomes
from vit_graph_backend.compile.backend import vitgraph
from vit_graph_backend.compile.patch_rewrite import patch_embeddings_as_gemm


class _Embed(nn.Module):
    """A convolution, then what the ViTs do with its output (or ``after`` instead)."""

    def __init__(self, kernel, stride, *, channels=3, width=8, bias=True, after=None, **conv):
        super().__init__()
        self.conv = nn.Conv2d(channels, width, kernel, stride, bias=bias, **conv)
        self.after = after

    def forward(self, x):
        y = self.conv(x)
        return self.after(y) if self.after else y.flatten(2).transpose(1, 2) + 1.0


def _rewrite(model, *inputs):
    """Trace ``model`` with Dynamo (batch axis dynamic), rewrite its graph; returns (count,
    the original graph's outputs, the rewritten graph's, the rewritten graph's call targets)
    for each of ``inputs``."""
    seen = {}

    def backend(gm, example_inputs):
        seen["original"] = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())
        seen["count"] = patch_embeddings_as_gemm(gm, example_inputs)
        seen["targets"] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        seen["rewritten"] = gm
        return gm

    results = []
    with torch.no_grad():
        for x in inputs:
            torch._dynamo.reset()
            torch._dynamo.mark_dynamic(x, 0)
            out = torch.compile(model, backend=backend, fullgraph=True)(x)
            ref = model(x)
            results.append((seen["count"], ref, out, seen["targets"]))
    return results


@pytest.mark.parametrize("model, shape", [
    (_Embed(14, 14), (2, 3, 56, 56)),                    # CLIP / SigLIP / DINOv2 at 14
    (_Embed(16, 16, bias=False), (3, 3, 64, 48)),        # no bias, a non-square image
    (_Embed(8, 8), (2, 3, 30, 21)),                      # sides not multiples: the rest dropped
    (_Embed((2, 4), (2, 4), channels=5), (2, 5, 10, 12)),  # a rectangular kernel
    (_Embed(1, 1, padding=0, dilation=1), (2, 3, 5, 5)),  # 1x1: a per-pixel linear layer
    (_Embed(16, 16, after=lambda y: y.view(y.shape[0], y.shape[1], -1)), (2, 3, 32, 32)),
    (_Embed(16, 16, after=lambda y: y), (2, 3, 32, 32)),  # the graph's output itself
])
def test_patch_convolution_becomes_a_gemm_with_the_same_result(model, shape):
    torch.manual_seed(0)
    model.eval()
    other = (shape[0] + 3, *shape[1:])
    for count, ref, out, targets in _rewrite(model, torch.randn(shape), torch.randn(other)):
        assert count == 1
        assert torch.conv2d not in targets and F.linear in targets
        assert out.shape == ref.shape and out.stride() == ref.stride()
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("conv", [
    dict(kernel_size=4, stride=2),                 # overlapping patches
    dict(kernel_size=4, stride=4, padding=1),
    dict(kernel_size=4, stride=4, dilation=2),
    dict(kernel_size=4, stride=4, groups=2, in_channels=4, out_channels=8),
    dict(kernel_size=(4, 2), stride=(2, 4)),
])
def test_other_convolutions_are_left_alone(conv):
    conv = {"in_channels": 4, "out_channels": 8, **conv}
    model = nn.Conv2d(**conv).eval()
    [(count, ref, out, _)] = _rewrite(model, torch.randn(2, 4, 16, 16))
    assert count == 0
    torch.testing.assert_close(out, ref)


def test_a_weight_computed_in_the_graph_is_left_alone():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 3, 4, 4))

        def forward(self, x):
            return F.conv2d(x, self.weight * 2.0, stride=4)

    [(count, ref, out, _)] = _rewrite(Scaled().eval(), torch.randn(2, 3, 16, 16))
    assert count == 0
    torch.testing.assert_close(out, ref)


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out.to_tuple() if isinstance(t, torch.Tensor)]


def _vits():
    timm = pytest.importorskip("timm")
    tr = pytest.importorskip("transformers")
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=14)
    return {
        "timm_vit": timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                                      patch_size=8, depth=2, num_classes=10),
        "hf_clip": tr.CLIPVisionModel(tr.CLIPVisionConfig(**common)),
        "hf_siglip": tr.SiglipVisionModel(tr.SiglipVisionConfig(**common)),
        "hf_dinov2": tr.Dinov2Model(tr.Dinov2Config(**common)),
    }


@pytest.mark.parametrize("name, inner", [
    ("timm_vit", "auto"), ("hf_clip", "auto"), ("hf_siglip", "auto"), ("hf_dinov2", "auto"),
    ("hf_clip", "inductor"),  # Inductor's lowering of the rewrite, as on a GPU by default
])
@torch.no_grad()
def test_vits_compiled_with_the_gemm_equal_eager(name, inner, caplog):
    torch.manual_seed(0)
    model = _vits()[name].eval()
    side = 32 if name == "timm_vit" else 28
    compiled = torch.compile(model, backend="vitgraph", options={
        "max_budget": 8, "patch_embedding": "gemm", "inner_compiler": inner})
    with caplog.at_level(logging.INFO, logger="vit_graph_backend.compile.backend"):
        for batch in (3, 5, 11):  # a static compile, a dynamic one, a call cut into chunks
            x = torch.randn(batch, 3, side, side)
            for got, ref in zip(_tensors(compiled(x)), _tensors(model(x)), strict=True):
                torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    rewrites = [r.getMessage() for r in caplog.records if "patch_embedding" in r.getMessage()]
    assert rewrites and all("1 patch convolutions as one GEMM" in m for m in rewrites), rewrites
    assert vitgraph.report()["stats"]["eager_items"] == 0


@pytest.mark.parametrize("options, rewritten", [({}, True), ({"patch_embedding": "conv"}, False)])
@torch.no_grad()
def test_the_default_rewrites_and_conv_leaves_the_convolution(options, rewritten, caplog):
    model = _Embed(8, 8).eval()
    with caplog.at_level(logging.INFO, logger="vit_graph_backend.compile.backend"):
        out = torch.compile(model, backend="vitgraph", options=options)(torch.randn(2, 3, 16, 16))
    logged = [r.getMessage() for r in caplog.records if "patch_embedding" in r.getMessage()]
    assert logged == (["vitgraph: patch_embedding='gemm': 1 patch convolutions as one GEMM each"]
                      if rewritten else [])
    assert out.shape == (2, 4, 8)


class _LinearShapes(torch.fx.Interpreter):
    """Runs a graph and records the shape of each ``F.linear``'s input and weight."""

    def __init__(self, gm):
        super().__init__(gm)
        self.shapes = []

    def call_function(self, target, args, kwargs):
        if target is F.linear:
            self.shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
        return super().call_function(target, args, kwargs)


@pytest.mark.parametrize("kernel, row", [(14, 592), (16, 768), (2, 16)])
@torch.no_grad()
def test_patch_rows_are_padded_to_a_multiple_of_8(kernel, row):
    """3 * 14 * 14 = 588 values a patch (CLIP, SigLIP, DINOv2) -> 592 with zeros, in the patches
    and the weight alike: cuBLAS's fast bf16 kernels want rows of 16-byte multiples. 768 at 16
    px needs none; 12 at 2 px becomes 16."""
    torch.manual_seed(0)
    model = _Embed(kernel, kernel).eval()
    seen = {}

    def backend(gm, example_inputs):
        patch_embeddings_as_gemm(gm, example_inputs)
        seen["gm"], seen["inputs"] = gm, example_inputs
        return gm

    x = torch.randn(2, 3, 2 * kernel, 3 * kernel)
    out = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)(x)
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    run = _LinearShapes(seen["gm"])
    run.run(*seen["inputs"])
    assert run.shapes == [((2, 2, 3, row), (8, row))]
    assert sum(n.target is F.pad for n in seen["gm"].graph.nodes) == (0 if row == 768 else 2)


@torch.no_grad()
def test_a_rewritten_graph_comes_from_the_compile_caches_the_second_time(tmp_path, monkeypatch):
    """What a warm first pass depends on: AOTAutograd's cache takes the rewritten graph (it
    passed it by when the inserted nodes were tensor method calls without Dynamo's fake values,
    and every process traced CLIP-L again; patch_rewrite.py)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = _vits()["hf_clip"].eval()  # patches of 14 px, 588 values: the padded path
    xs = [torch.randn(3, 3, 28, 28), torch.randn(5, 3, 28, 28)]
    counts = []
    for _ in range(2):
        torch._dynamo.reset()
        with cache_outcomes() as outcomes:
            compiled = torch.compile(model, backend="vitgraph",
                                     options={"max_budget": 4, "inner_compiler": "inductor"})
            for x in xs:  # a static graph, its inner compile deferred (batched.py), then dynamic
                got = compiled(x).last_hidden_state
                torch.testing.assert_close(got, model(x).last_hidden_state, atol=1e-4, rtol=1e-4)
        counts.append(outcomes)
    assert counts[0].get("autograd_cache_bypass", 0) == 0 and counts[0], counts
    assert counts[1].get("autograd_cache_hit", 0) >= 1, counts
