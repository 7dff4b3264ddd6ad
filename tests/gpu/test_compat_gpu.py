"""``_compat``'s wrappers of private PyTorch ops on CUDA, where their results differ from the CPU's
(``tests/unit/test_compat.py`` checks the CPU side)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vit_graph_backend import _compat

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_addmm_gelu_tanh_on_cuda_is_the_tanh_gelu():
    """fp32, TF32 off: the tanh and exact GELUs differ by up to about 5e-4, far above the GEMM's
    rounding, so this tells which GELU cuBLASLt's epilogue (or PyTorch's fallback) computed."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, w, b = (torch.randn(*shape, device="cuda", generator=gen)
               for shape in ((512, 256), (384, 256), (384,)))
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        got = _compat.addmm_gelu_tanh(x, w, b)
        y = F.linear(x.double(), w.double(), b.double())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    torch.testing.assert_close(got.double(), F.gelu(y, approximate="tanh"), atol=1e-4, rtol=1e-5)
    assert (got.double() - F.gelu(y)).abs().max() > 2e-4


def test_addmm_gelu_tanh_on_cuda_in_bf16_matches_the_unfused_pair():
    gen = torch.Generator(device="cuda").manual_seed(1)
    x, w, b = (torch.randn(*shape, device="cuda", generator=gen).bfloat16()
               for shape in ((729, 1152), (4304, 1152), (4304,)))
    w = w / 1152 ** 0.5
    ref = F.gelu(F.linear(x.float(), w.float(), b.float()), approximate="tanh")
    got = _compat.addmm_gelu_tanh(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (729, 4304)
    assert (got.float() - ref).abs().max() < 0.05


def test_the_one_call_address_check_reads_cuda_tensors():
    # the binding cudagraph_trees checks static inputs with; only CUDA builds have it
    assert _compat._PTRS_EQUAL is torch._C._tensors_data_ptrs_at_indices_equal
    weights = [torch.zeros(4, device="cuda") for _ in range(3)]
    ptrs = [w.data_ptr() for w in weights]
    assert _compat.data_ptrs_equal(weights, ptrs, [0, 1, 2])
    weights[0] = weights[0].clone()
    assert not _compat.data_ptrs_equal(weights, ptrs, [0, 1, 2])
    assert _compat.data_ptrs_equal(weights, ptrs, [1, 2])
