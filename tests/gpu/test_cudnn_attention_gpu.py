"""cuDNN ragged segment attention (``adapters/_cudnn_attention.py``) on CUDA: against a float32
per-segment reference on the packed layouts the Qwen adapters pass (q and k strided views of one
buffer, v another, zero-length segment slots), inside a captured CUDA graph whose offsets change
between replays, and served Qwen towers with ``packed_attention="cudnn"`` (full attention through
cuDNN, window layers through flash varlen) against HF. Needs
``nvidia-cudnn-frontend`` (``scripts/gpu_check.sh`` installs it from ``.whl/`` when carried);
without it these tests skip, and the default path (flash varlen) is what the other GPU tests
run."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from vit_graph_backend.kernels.cudnn_attention import (
    RaggedAttention,
    cudnn_frontend_reason,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(cudnn_frontend_reason() is not None,
                                 reason=f"{cudnn_frontend_reason()}")]

DEV, DT = "cuda", torch.bfloat16


def _packed(rows, heads, dim, gen):
    """q, k, v as the adapter has them: q and k from one ``(rows, 2, heads, dim)`` buffer, v a
    view of the ``(rows, 3, heads, dim)`` qkv projection."""
    qkv = torch.randn(rows, 3, heads, dim, device=DEV, dtype=DT, generator=gen)
    qk = torch.randn(rows, 2, heads, dim, device=DEV, dtype=DT, generator=gen)
    q, k = qk.unbind(1)
    return q, k, qkv[:, 2]


def _offsets(lengths, slots):
    ends = torch.tensor(lengths + [0] * (slots - len(lengths)), dtype=torch.int32).cumsum(0)
    return F.pad(ends, (1, 0)).to(torch.int32).to(DEV)


def _reference(q, k, v, lengths, scale):
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n].float().transpose(0, 1) for x in (q, k, v))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize(("heads", "dim"), [(2, 32), (16, 72), (16, 80)])
@pytest.mark.parametrize("lengths", [[300, 1, 517, 64], [100, 37, 200]])
@torch.no_grad()
def test_matches_a_float32_reference_on_strided_views_and_empty_slots(heads, dim, lengths):
    gen = torch.Generator(device=DEV).manual_seed(dim)
    slots = len(lengths) + 3  # three zero-length slots after the real ones
    rows = sum(lengths)
    q, k, v = _packed(rows, heads, dim, gen)
    ragged = RaggedAttention()
    out = ragged(q, k, v, _offsets(lengths, slots), max(lengths), dim ** -0.5)
    assert out is not None, ragged.state
    ref = _reference(q, k, v, lengths, dim ** -0.5)
    err = (out.float() - ref).abs().max().item()
    print(f"cuDNN ragged, heads {heads} x {dim}, segments {lengths}: max abs error vs float32 "
          f"{err:.3g}")
    assert torch.isfinite(out).all() and err < 2e-2
    assert ragged.state == {"plans": 1, "refused": {}}


@torch.no_grad()
def test_a_captured_graph_follows_new_offsets_at_every_replay():
    """One plan built by a warm-up run, one capture, then replays with other segment lengths
    written into the same offset buffer: each replay equals the reference for its lengths."""
    heads, dim, rows, slots = 4, 64, 1024, 6
    gen = torch.Generator(device=DEV).manual_seed(1)
    q, k, v = _packed(rows, heads, dim, gen)
    offsets = _offsets([rows], slots)
    ragged = RaggedAttention()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ragged(q, k, v, offsets, rows, dim ** -0.5)  # the warm-up builds the plan
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ragged(q, k, v, offsets, rows, dim ** -0.5)
    assert out is not None
    rng = random.Random(3)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, rows), slots - 2))
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, rows], strict=True)]
        offsets.copy_(_offsets(lengths, slots))
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, device=DEV, dtype=DT, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        ref = _reference(q, k, v, lengths, dim ** -0.5)
        assert (out.float() - ref).abs().max().item() < 2e-2, lengths


@torch.no_grad()
def test_a_shape_first_met_inside_a_capture_is_left_to_flash():
    heads, dim, rows = 2, 32, 256
    q, k, v = _packed(rows, heads, dim, torch.Generator(device=DEV).manual_seed(2))
    ragged = RaggedAttention()
    offsets = _offsets([rows], 2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = ragged(q, k, v, offsets, rows, dim ** -0.5)
    assert got is None and ragged.state == {"plans": 0, "refused": {}}


@torch.no_grad()
def test_a_refused_shape_is_remembered_with_its_reason():
    q, k, v = (torch.randn(64, 2, 32, device=DEV) for _ in range(3))  # float32: not served
    ragged = RaggedAttention()
    offsets = _offsets([64], 2)
    assert ragged(q, k, v, offsets, 64, 32 ** -0.5) is None
    assert ragged(q, k, v, offsets, 64, 32 ** -0.5) is None  # asked again: not rebuilt
    (reason,) = ragged.state["refused"].values()
    assert "float32" in reason and ragged.state["plans"] == 0


@pytest.mark.parametrize("kind", ["qwen2_5", "qwen3"])
@torch.no_grad()
def test_served_towers_with_cudnn_attention_match_hf(kind):
    """Several images per graph (full attention over frames, Qwen2.5-VL's window layers too),
    every segment kernel in the graphs cuDNN's."""
    from packed_towers import PATCH, _tower, _worst_error_vs_hf

    from vit_graph_backend import serve

    tower = _tower(kind)
    patch = 16 if kind == "qwen3" else PATCH
    served = serve(tower, max_items_per_graph=4, max_budget=512, packed_attention="cudnn")
    worst = _worst_error_vs_hf(served, tower, random.Random(5), 10,
                               lambda rng: rng.randint(1, 4), patch)
    state = served.encoder.attention_state
    print(f"{kind}, packed_attention='cudnn': max relative error vs HF (bf16) {worst:.3g}; "
          f"cuDNN {state['cudnn']}")
    assert worst < 5e-2
    assert state["segments"] == "cudnn" and state["cudnn"]["refused"] == {}
    assert state["cudnn"]["plans"] >= served.manager.num_graphs
    assert served.manager.stats.graph_replays > 0 and served.manager.stats.eager_items == 0
