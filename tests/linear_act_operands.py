"""Operands and references the fused-linear GPU tests share (``tests/gpu/test_fused_linear*_gpu.py``):
random bf16 layers, their float32 results, the bound a bf16 result must keep, and the gated
(SiLU-mul) form's packed operands, and a small HF CLIP run through ``torch.compile(backend="vitgraph")``
against eager."""

from __future__ import annotations

import pytest
import torch

from vit_graph_backend.kernels.fused_linear import (
    fused_epilogue_unavailable,
    linear_act_reference,
    linear_silu_mul_reference,
    pack_gated,
)

#: The marks of every test that runs the fused kernel (``pytestmark`` of those files).
FUSED_KERNEL_TESTS = [
    pytest.mark.gpu,
    pytest.mark.skipif(fused_epilogue_unavailable(torch.device("cuda")) is not None
                       if torch.cuda.is_available() else False,
                       reason="the fused kernel needs a Hopper or newer GPU with Triton")]
DEV, DT = "cuda", torch.bfloat16
OP = torch.ops.vitgraph.linear_act.default
GATED_OP = torch.ops.vitgraph.linear_silu_mul.default


def _operands(rows, k, n, seed=0, bias=True):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(rows, k, device=DEV, dtype=DT, generator=gen)
    w = torch.randn(n, k, device=DEV, dtype=DT, generator=gen) / k ** 0.5
    b = torch.randn(n, device=DEV, dtype=DT, generator=gen) if bias else None
    return x, w, b


def _fp32(x, w, b, activation):
    return linear_act_reference(x.float(), w.float(), None if b is None else b.float(), activation)


def _bf16_close(out, ref, roundings=2):
    """Within bf16's rounding of the result (8 bits of mantissa: up to 2**-8 relative) plus the
    fp32 accumulation's order; the unfused path rounds the GEMM's output once more before its
    activation, hence 2 roundings; the gated form's unfused path rounds the gate and the up
    projection before their product (and SiLU's slope reaches 1.1), hence 4 for it. The 1e-2
    absolute term covers the approximate tanh where 1 + tanh cancels (large negative inputs)."""
    err = (out.float() - ref).abs()
    bound = roundings * 2.0 ** -8 * ref.abs() + 1e-2
    assert (err <= bound).all(), f"max error {err.max().item():.3e}"


def _gated_operands(rows, k, width, seed, bias=True):
    """x and the packed gate/up weight and bias (``pack_gated``) of a ``width``-wide MLP."""
    x, gw, gb = _operands(rows, k, width, seed=seed, bias=bias)
    _, uw, ub = _operands(rows, k, width, seed=seed + 100, bias=bias)
    return x, pack_gated(gw, uw), pack_gated(gb, ub) if bias else None


def _gated_fp32(x, weight, bias):
    return linear_silu_mul_reference(x.float(), weight.float(),
                                     None if bias is None else bias.float())


def _clip(layers=4):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CLIPVisionConfig(hidden_size=256, intermediate_size=1024,
                                        num_hidden_layers=layers, num_attention_heads=4,
                                        image_size=224, patch_size=14)
    torch.manual_seed(0)
    return transformers.CLIPVisionModel(cfg).to(DEV, DT).eval()


def _compiled_matches_eager(model, **options):
    """``model`` (:func:`_clip`) through ``torch.compile(backend="vitgraph")`` with budgets of 2
    and 6 images and ``options``, at 2, 5 and 6 images, within bf16's tolerance of eager."""
    compiled = torch.compile(model, backend="vitgraph", options={"budgets": [2, 6], **options})
    with torch.no_grad():
        for batch in (2, 5, 6):
            x = torch.randn(batch, 3, 224, 224, device=DEV, dtype=DT)
            ref = model(pixel_values=x).last_hidden_state.float()
            out = compiled(pixel_values=x).last_hidden_state.float()
            rel = ((out - ref).abs().max() / ref.abs().max()).item()
            assert rel < 3e-2, (batch, rel)
