"""The linear+activation op's cuBLASLt candidate (``fused_linear._CUBLASLT``: cuBLASLt's GEMM with
bias and tanh GELU in its epilogue) on CPU, with the timing stood in for: timed only for the tanh
GELU with a bias, refused for good when it fails, and computing the layer's tanh GELU. On a GPU:
``tests/gpu/test_cublaslt_epilogue_gpu.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _candidates_timed(monkeypatch, activation, bias, fail=None):
    """The candidates ``LinearActChoices._time`` hands to ``time_each`` for one shape, and what
    it chose; ``fail``: a candidate whose timing raises that (the others take 1 ms, the
    cuBLASLt epilogue 0.5)."""
    from vit_graph_backend.kernels import fused_linear

    seen = []

    def time_each(candidates, run, **kwargs):
        candidates = list(candidates)
        seen.append(candidates)
        failures = {c: ("RuntimeError: no", False) for c in candidates if c == fail}
        times = {c: 0.5 if c == "cublaslt epilogue" else 1.0 for c in candidates if c != fail}
        return times, failures

    monkeypatch.setattr(fused_linear, "time_each", time_each)
    monkeypatch.setattr(fused_linear, "_kernels", lambda: (None, "no Triton here"))
    choices = fused_linear.LinearActChoices()
    w = torch.ones(16, 8)
    b = torch.ones(16) if bias else None
    chosen = choices._time(torch.ones(4, 8), w, b, activation)
    return seen[0], chosen, choices


def test_cublaslt_epilogue_is_a_candidate_for_the_tanh_gelu_with_a_bias_only(monkeypatch):
    candidates, chosen, _ = _candidates_timed(monkeypatch, "gelu_tanh", bias=True)
    assert candidates[:2] == ["cublas+activation", "cublaslt epilogue"]
    assert chosen == "cublaslt epilogue"   # timed fastest
    for activation, bias in (("gelu_tanh", False), ("gelu", True), ("quick_gelu", True),
                             ("silu_mul", True)):
        candidates, chosen, _ = _candidates_timed(monkeypatch, activation, bias)
        assert "cublaslt epilogue" not in candidates, (activation, bias)


def test_a_cublaslt_epilogue_that_fails_is_refused_and_not_timed_again(monkeypatch):
    _, chosen, choices = _candidates_timed(monkeypatch, "gelu_tanh", bias=True,
                                           fail="cublaslt epilogue")
    assert chosen == "cublas+activation"
    assert choices.state["refused"] == {"cublaslt epilogue": "RuntimeError: no"}
    seen = []
    from vit_graph_backend.kernels import fused_linear

    monkeypatch.setattr(fused_linear, "time_each", lambda candidates, run, **kw: (
        seen.append(list(candidates)) or ({"cublas+activation": 1.0}, {})))
    choices._time(torch.ones(6, 8), torch.ones(16, 8), torch.ones(16), "gelu_tanh")
    assert "cublaslt epilogue" not in seen[0]


def test_the_cublaslt_epilogue_computes_the_tanh_gelu_of_the_layer():
    from vit_graph_backend.kernels import fused_linear

    torch.manual_seed(0)
    x, w, b = torch.randn(5, 8), torch.randn(16, 8), torch.randn(16)
    got = fused_linear.LinearActChoices._launch("cublaslt epilogue", x, w, b, "gelu_tanh")
    torch.testing.assert_close(got, F.gelu(F.linear(x, w, b), approximate="tanh"))
