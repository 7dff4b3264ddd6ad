"""``attention_kernel`` on CPU: which Dynamo graph nodes the rewrite takes (HF CLIP's and timm's
attention) and which it leaves, that a rewritten graph computes what the original did (the op's
SDPA path runs here), the layouts the kernel reads, the op's registration, the per-shape timing's
handling of failures, and the option's checks. The Triton kernel, the timing itself and captured
graphs are ``tests/gpu/test_attention_op_gpu.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from vit_graph_backend import VitGraphOptions, attention_op
from vit_graph_backend.attention_op import (
    attention_unavailable,
    reads_rows,
    rewrite_attention,
)
from vit_graph_backend.errors import InvalidOptionError

DT = torch.bfloat16
OP = torch.ops.vitgraph.attention.default


def _rewrite(model, *inputs):
    """Trace ``model`` with Dynamo and rewrite its graph; returns (count, the original graph's
    output, the rewritten graph's output, the rewritten graph's call targets)."""
    seen = {}

    def backend(gm, example_inputs):
        seen["original"] = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())
        seen["count"] = rewrite_attention(gm, example_inputs)
        seen["targets"] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        seen["args"] = example_inputs
        return gm

    with torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(*inputs)
        ref = seen["original"](*seen["args"])[0]   # Dynamo's graphs return a tuple
    return seen["count"], ref, out, seen["targets"]


class _Attention(nn.Module):
    """Self-attention as the ViTs write it: ``[B, T, H, D]`` projections viewed and transposed,
    SDPA with ``kwargs``, and ``layout`` to change how q, k and v reach it."""

    def __init__(self, width=64, heads=4, layout="views", **kwargs):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.heads, self.layout, self.kwargs = heads, layout, kwargs

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        if self.layout == "contiguous":            # [B, H, T, D] memory: tokens do not merge
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        elif self.layout == "cross":               # keys of another length
            k, v = k[:, :, :-1], v[:, :, :-1]
        elif self.layout == "3d":
            q, k, v = (y.flatten(0, 1) for y in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, **self.kwargs)
        return out.transpose(-3, -2).reshape(b, t, c) if out.dim() == 4 else out


def test_hf_clip_attention_becomes_the_op_with_the_same_result():
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    config = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=4, image_size=32, patch_size=8)
    model = CLIPVisionModel(config).to(DT).eval()
    count, ref, out, targets = _rewrite(model, torch.randn(3, 3, 32, 32, dtype=DT))
    assert count == 3 and targets.count(OP) == 3
    assert F.scaled_dot_product_attention not in targets
    torch.testing.assert_close(out.last_hidden_state, ref, rtol=0, atol=0)


def test_timm_attention_on_one_packed_projection_becomes_the_op():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0,
                              img_size=32, patch_size=8).to(DT).eval()
    count, ref, out, _ = _rewrite(model, torch.randn(2, 3, 32, 32, dtype=DT))
    assert count == 12
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("case", [
    {"attn_mask": "mask"}, {"is_causal": True}, {"dropout_p": 0.1}, {"enable_gqa": True},
    {"layout": "contiguous"}, {"layout": "cross"}, {"layout": "3d"}, {"dtype": torch.float32},
])
def test_what_the_rewrite_leaves_alone(case):
    torch.manual_seed(1)
    case = dict(case)
    dtype = case.pop("dtype", DT)
    layout = case.pop("layout", "views")
    x = torch.randn(2, 9, 64, dtype=dtype)
    if case.get("attn_mask") == "mask":
        case["attn_mask"] = torch.ones(9, 9, dtype=torch.bool).tril()
    model = _Attention(layout=layout, **case).to(dtype)
    if "dropout_p" not in case:
        model.eval()
    count, ref, out, targets = _rewrite(model, x)
    assert count == 0 and OP not in targets
    if "dropout_p" not in case:
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_a_given_scale_reaches_the_op():
    torch.manual_seed(2)
    model = _Attention(scale=0.3).to(DT)
    x = torch.randn(2, 9, 64, dtype=DT)
    count, ref, out, _ = _rewrite(model, x)
    assert count == 1
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    with torch.no_grad():   # and it is not the default scale's result
        default = _Attention()
        default.load_state_dict(model.state_dict())
        assert (default.to(DT)(x) - out).abs().max() > 1e-2


def test_the_op_has_a_fake_kernel_and_returns_tokens_major_memory():
    q, k, v = (torch.randn(2, 7, 4, 16, dtype=DT).transpose(1, 2) for _ in range(3))
    torch.library.opcheck(OP, (q, k, v, None))
    torch.library.opcheck(OP, (q, k, v, 0.5))
    out = OP(q, k, v, None)
    assert out.shape == (2, 4, 7, 16)
    assert out.transpose(1, 2).is_contiguous()    # the models' transpose + reshape: a view
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=0, atol=0)


def test_the_layouts_the_kernel_reads():
    b, h, t, d = 3, 4, 10, 16
    views = torch.randn(b, t, h, d, dtype=DT).transpose(1, 2)
    assert reads_rows(views)
    packed = torch.randn(b, t, 3, h, d, dtype=DT).permute(2, 0, 3, 1, 4)[0]   # timm's qkv
    assert reads_rows(packed)
    assert not reads_rows(views.contiguous())             # [B, H, T, D] memory
    assert reads_rows(views.contiguous()[:1])             # one image: its tokens are its rows
    assert not reads_rows(torch.randn(b, t, h, 4, dtype=DT).transpose(1, 2))   # 8-byte heads
    assert not reads_rows(torch.randn(b, t, h, 2 * d, dtype=DT).transpose(1, 2)[..., ::2])
    row = attention_op.rows_view(packed)
    assert row.shape == (b * t, h, d) and row.data_ptr() == packed.data_ptr()


def test_option_is_checked_when_built():
    assert VitGraphOptions(attention_kernel="timed").attention_kernel == "timed"
    assert VitGraphOptions().attention_kernel == "sdpa"
    with pytest.raises(InvalidOptionError,
                       match=r"attention_kernel='auto' is invalid.*'sdpa', 'timed'"):
        VitGraphOptions.from_compile_kwargs({"attention_kernel": "auto"})


def test_cpu_graph_is_left_alone_and_says_why(caplog):
    assert "not a CUDA GPU" in attention_unavailable(torch.device("cpu"))
    torch.manual_seed(3)
    model = _Attention().to(DT).eval()
    x = torch.randn(2, 9, 64, dtype=DT)
    with caplog.at_level(logging.INFO, logger="vit_graph_backend"), torch.no_grad():
        out = torch.compile(model, backend="vitgraph",
                            options={"attention_kernel": "timed"})(x)
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    assert any("attention_kernel='timed' leaves attention to SDPA" in r.message
               and "cpu" in r.message for r in caplog.records)


def _timed_with(monkeypatch, failure):
    """``AttentionChoices._time`` with every Triton config raising ``failure`` and SDPA running:
    the timer only calls its work here (the graph timing is a GPU test)."""

    def launch(self, choice, q, k, v, scale):
        if choice != "sdpa":
            raise failure
        return q

    monkeypatch.setattr(attention_op.AttentionChoices, "_launch", launch)
    monkeypatch.setattr(attention_op, "graph_ms", lambda fn, calls, reps: fn() is not None)
    choices = attention_op.AttentionChoices()
    q = torch.ones(2, 4, 8, 16)
    return choices, choices._time(q, q, q, None)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"),
                                   RuntimeError("CUDA error: out of memory")])
def test_a_config_out_of_memory_while_timed_is_not_refused(monkeypatch, error):
    choices, choice = _timed_with(monkeypatch, error)
    assert choice == "sdpa"
    assert choices.state["refused"] == {}   # tried again at the next shape


def test_a_config_that_fails_to_build_is_refused(monkeypatch):
    choices, choice = _timed_with(monkeypatch, RuntimeError("out of resources"))
    assert choice == "sdpa"
    assert set(choices.state["refused"]) == {"triton 64x64x4x3", "triton 128x64x4x3"}
    assert set(choices.state["refused"].values()) == {"RuntimeError: out of resources"}


def test_nothing_timed_leaves_sdpa(monkeypatch):
    monkeypatch.setattr(attention_op, "graph_ms", lambda fn, calls, reps: (_ for _ in ()).throw(
        torch.OutOfMemoryError("CUDA out of memory")))
    choices = attention_op.AttentionChoices()
    q = torch.ones(2, 4, 8, 16)
    assert choices._time(q, q, q, None) == "sdpa"
    assert choices.state["refused"] == {}
