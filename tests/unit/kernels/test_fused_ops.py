"""The fused block functions (``adapters._fused``) and the GEMM patch embedding: each equals the
HF module it replaces, and the compile wrapper compiles once for every row count and falls back
(logged) when compiling fails. Inductor itself is exercised on CUDA (tests/gpu); here a counting
Dynamo backend stands in for it, so the tests are fast on CPU."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf_qwen  # noqa: E402

from vit_graph_backend.kernels import fused_ops as _fused  # noqa: E402
from vit_graph_backend.adapters.qwen import _add_norm, _norm, _patch_embed  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
Qwen2_5_VisionPatchEmbed = hf_qwen.Qwen2_5_VisionPatchEmbed
# the tower's RMSNorm class (renamed across transformers 5.x releases)
Qwen2RMSNorm = getattr(hf_qwen, "Qwen2_5_VLRMSNorm", None) or hf_qwen.Qwen2RMSNorm


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_equals_hf_residual_then_norm(dtype):
    norm = Qwen2RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_rand(64, seed=3, dtype=dtype))
    hidden, update = _rand(37, 64, seed=1, dtype=dtype) * 3, _rand(37, 64, seed=2, dtype=dtype)
    got_hidden, got_normed = _fused.add_rms_norm(hidden, update, norm.weight,
                                                 norm.variance_epsilon)
    with torch.no_grad():
        expected = norm(hidden + update)
    torch.testing.assert_close(got_hidden, hidden + update, atol=0, rtol=0)
    # bf16: F.rms_norm applies the weight before its one rounding, HF after: one ulp apart
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 0, "rtol": 2**-7}
    torch.testing.assert_close(got_normed, expected, **tol)


def test_add_layer_norm_equals_layer_norm_module():
    norm = torch.nn.LayerNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(_rand(48, seed=4))
        norm.bias.copy_(_rand(48, seed=5))
    hidden, update = _rand(9, 48, seed=6), _rand(9, 48, seed=7)
    got_hidden, got_normed = _fused.add_layer_norm(hidden, update, norm.weight, norm.bias, norm.eps)
    with torch.no_grad():
        torch.testing.assert_close(got_normed, norm(hidden + update), atol=0, rtol=0)
    torch.testing.assert_close(got_hidden, hidden + update, atol=0, rtol=0)


def test_add_norm_dispatch_covers_rms_layer_other_and_none():
    fns = _fused.ops(False)
    hidden, update = _rand(5, 8, seed=8), _rand(5, 8, seed=9)
    other = torch.nn.Tanh()  # neither RMSNorm nor LayerNorm: applied as a module
    for norm in (Qwen2RMSNorm(8), torch.nn.LayerNorm(8), other):
        got_hidden, got_normed = _add_norm(fns, norm, hidden, update)
        with torch.no_grad():
            torch.testing.assert_close(got_normed, norm(hidden + update), atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(_norm(norm, hidden), norm(hidden), atol=1e-6, rtol=1e-6)
    got_hidden, got_normed = _add_norm(fns, None, hidden, update)
    assert got_normed is None
    torch.testing.assert_close(got_hidden, hidden + update)


def test_silu_mul_equals_silu_times_up():
    gate, up = _rand(6, 10, seed=10), _rand(6, 10, seed=11)
    torch.testing.assert_close(_fused.silu_mul(gate, up), F.silu(gate) * up, atol=0, rtol=0)


@pytest.mark.parametrize("bias", [False, True])
def test_patch_embed_gemm_equals_hf_conv3d(bias):
    embed = Qwen2_5_VisionPatchEmbed(patch_size=4, temporal_patch_size=2, in_channels=3,
                                     embed_dim=24)
    if bias:  # Qwen3-VL's patch embedding has a bias
        embed.proj = torch.nn.Conv3d(3, 24, kernel_size=[2, 4, 4], stride=[2, 4, 4], bias=True)
    pixels = _rand(13, 3 * 2 * 4 * 4, seed=12)
    with torch.no_grad():
        torch.testing.assert_close(_patch_embed(embed, pixels), embed(pixels),
                                   atol=1e-5, rtol=1e-5)


def test_patch_embed_other_modules_run_as_they_are():
    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Conv3d(3, 8, kernel_size=2, stride=1)  # overlapping windows

        def forward(self, x):
            return x * 2

    x = _rand(3, 24, seed=13)
    torch.testing.assert_close(_patch_embed(Linear(), x), x * 2)


class CountingBackend:
    """A Dynamo backend that records each graph's input shapes and runs it as traced."""

    def __init__(self):
        self.shapes = []

    def __call__(self, gm, example_inputs):
        self.shapes.append([tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)])
        return gm


def test_compiled_function_compiles_once_for_every_row_count():
    torch.compiler.reset()
    backend = CountingBackend()
    fns = _fused.Ops(compiled=True, backend=backend)
    for rows in (8, 24, 5, 64):
        gate, up = _rand(rows, 12, seed=rows), _rand(rows, 12, seed=rows + 1)
        torch.testing.assert_close(fns.silu_mul(gate, up), F.silu(gate) * up)
    assert len(backend.shapes) == 1, backend.shapes
    assert fns.failures() == {}


def test_compile_failure_falls_back_unfused_with_one_logged_reason(caplog):
    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    torch.compiler.reset()
    fns = _fused.Ops(compiled=True, backend=broken)
    gate, up = _rand(4, 6, seed=14), _rand(4, 6, seed=15)
    with caplog.at_level(logging.WARNING, logger="vit_graph_backend"):
        first = fns.silu_mul(gate, up)
        second = fns.silu_mul(gate, up)
    torch.testing.assert_close(first, F.silu(gate) * up)
    torch.testing.assert_close(second, first)
    assert "no compiler here" in fns.failures()["silu_mul"]
    messages = [r.getMessage() for r in caplog.records if "silu_mul" in r.getMessage()]
    assert len(messages) == 1 and "unfused" in messages[0]


def test_ops_are_shared_per_process_and_plain_when_not_compiled():
    assert _fused.ops(True) is _fused.ops(True)
    assert _fused.ops(False).silu_mul is _fused.silu_mul


def test_fusion_is_unavailable_off_cuda_with_a_reason():
    reason = _fused.fusion_available(torch.device("cpu"))
    assert reason is not None and "CUDA" in reason


def test_rotate_qk_wide_is_rotate_qk_then_the_dense_widening_and_traces_once():
    """The dense-attention path's fused function equals the rotary embedding followed by
    ``widen_for_dense``, and one trace serves every row count (the row dimension is dynamic,
    the real-row tensor is data)."""
    from vit_graph_backend.kernels.packed_attention import widen_for_dense

    torch.compiler.reset()
    backend = CountingBackend()
    fns = _fused.Ops(compiled=True, backend=backend)
    for rows, real in ((12, 7), (40, 40), (23, 1)):
        qkv = _rand(rows, 3, 2, 8, seed=rows)
        cos, ssin = _rand(rows, 1, 1, 8, seed=rows + 1), _rand(rows, 1, 1, 8, seed=rows + 2)
        end = torch.tensor([real])
        q, k = _fused.rotate_qk(qkv, cos, ssin)
        expected = widen_for_dense(q, k, qkv[:, 2], end)
        got = fns.rotate_qk_wide(qkv, cos, ssin, end)
        assert got.shape == (3, rows, 2, 16)
        torch.testing.assert_close(got, expected)
        assert (got[1, real:, :, 8] < -1e5).all() and not got[1, :real, :, 8].any()
    assert len(backend.shapes) == 1, backend.shapes
