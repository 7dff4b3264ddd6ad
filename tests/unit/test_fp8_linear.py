"""``quantization="fp8"`` on CPU: the quantizers, the graph rewrite and its weight refresh
(checked against a dequantize-then-matmul reference computed here), and the option checks.

The FP8 GEMM itself (``torch._scaled_mm``) runs on CPU too, so the rewritten graph runs here;
the GPU path (captured graphs, Inductor) is ``tests/gpu/test_fp8_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vit_graph_backend import VitGraphOptions
from vit_graph_backend.errors import InvalidOptionError
from vit_graph_backend.fp8_linear import (E4M3_MAX, check_fp8_device, fp8_linear,
                                          quantize_linears, quantize_rows, quantize_weight)


def test_quantize_rows_error_is_within_e4m3_resolution():
    x = torch.randn(64, 96) * torch.logspace(-3, 3, 64).unsqueeze(1)  # rows of very unlike scale
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    back = q.float() * scale
    amax = x.abs().amax(dim=1, keepdim=True)
    # e4m3 keeps 3 mantissa bits: relative step 1/8, so rounding is within 1/16 of a value, and
    # values far below the row's largest fall to the subnormal floor (2**-9 of 448).
    bound = x.abs() / 16 + amax * 2.0 ** -9 / E4M3_MAX * 448 + 1e-30
    assert ((back - x).abs() <= bound).all()
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((64,), E4M3_MAX))


def test_zero_rows_quantize_to_zero_not_nan():
    q, scale = quantize_rows(torch.zeros(3, 32))
    assert not torch.isnan(q.float()).any() and (q.float() == 0).all()
    assert (scale > 0).all()


def test_weight_scales_are_per_output_channel():
    w = torch.randn(48, 32)
    w[5] *= 100
    q, scale = quantize_weight(w)
    assert q.shape == (48, 32) and scale.shape == (1, 48)
    torch.testing.assert_close(scale[0], w.abs().amax(dim=1) / E4M3_MAX)


def _dequantized_linear(x, weight, bias):
    """Reference: both sides quantized and dequantized in fp32, then an fp32 matmul."""
    xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]))
    wq, ws = quantize_weight(weight)
    out = (xq.float() * xs) @ (wq.float() * ws.t()).t()
    if bias is not None:
        out = out + bias.to(torch.bfloat16).float()
    # the GEMM's output is bf16, and the next layer quantizes that rounded value
    return out.to(torch.bfloat16).float().reshape(*x.shape[:-1], weight.shape[0])


def test_fp8_linear_matches_the_dequantized_reference():
    x, w, b = torch.randn(2, 5, 64), torch.randn(32, 64), torch.randn(32)
    q, scale = quantize_weight(w)
    got = fp8_linear(x, q, scale, b, torch.float32)
    assert got.dtype == torch.float32 and got.shape == (2, 5, 32)
    ref = _dequantized_linear(x, w, b)
    # the GEMM accumulates in fp32 and rounds its output to bf16 (2**-8 relative)
    torch.testing.assert_close(got, ref, rtol=2 ** -7, atol=1e-3)


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.fc1 = torch.nn.Linear(64, 128)
        self.fc2 = torch.nn.Linear(128, 64)
        self.head = torch.nn.Linear(64, 10)  # 10 is not a multiple of 16: stays as it is

    def forward(self, x):
        h = self.fc2(F.gelu(self.fc1(self.norm(x))))
        return self.head(x + h)


def _reference(model, x):
    """The model with fc1 and fc2 computed as ``_dequantized_linear`` (head exact)."""
    h = _dequantized_linear(model.norm(x), model.fc1.weight, model.fc1.bias)
    h = _dequantized_linear(F.gelu(h), model.fc2.weight, model.fc2.bias)
    return model.head(x + h)


def _assert_close_to_max(got, ref, fraction=1e-2):
    """Max abs error within ``fraction`` of the reference's largest value (the GEMM's fp32
    accumulation order differs from the reference's)."""
    err = (got - ref).abs().max().item()
    assert err <= fraction * ref.abs().max().item(), (err, ref.abs().max().item())


def _compile_quantized(model):
    found = {}

    def backend(gm, example_inputs):
        gm, found["weights"] = quantize_linears(gm, example_inputs)
        found["targets"] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        weights = found["weights"]

        def call(*args):
            weights.refresh(args)
            return gm(*args)
        return call

    return torch.compile(model, backend=backend, dynamic=False), found


@torch.no_grad()
def test_rewrite_quantizes_eligible_linears_and_matches_reference():
    torch.manual_seed(0)
    model = _Mlp()
    fn, found = _compile_quantized(model)
    x = torch.randn(3, 7, 64)
    got = fn(x)
    assert found["targets"].count(fp8_linear) == 2
    assert found["targets"].count(F.linear) == 1  # the 10-wide head
    _assert_close_to_max(got, _reference(model, x))
    # and FP8 really ran: the unquantized model is measurably different
    assert (got - model(x)).abs().max() > 1e-4


def _load_new_state(model):
    model.load_state_dict(_Mlp().state_dict())  # copies in place: the storages stay


def _replace_fc1_weight(model):
    model.fc1.weight = torch.nn.Parameter(torch.randn(128, 64) * 0.2)


def _quantized_after_one_call(seed):
    """A fresh ``_Mlp``, its quantized compile, and an input it has been called with once."""
    torch.manual_seed(seed)
    model = _Mlp()
    fn, found = _compile_quantized(model)
    x = torch.randn(2, 4, 64)
    fn(x)
    return model, fn, found["weights"], x


@pytest.mark.parametrize(("change", "requantized"), [(_load_new_state, 2),
                                                     (_replace_fc1_weight, 1)])
@torch.no_grad()
def test_changed_weights_are_requantized(change, requantized):
    model, fn, weights, x = _quantized_after_one_call(1)
    assert weights.requantized == 0
    change(model)
    got = fn(x)
    assert weights.requantized == requantized
    _assert_close_to_max(got, _reference(model, x))
    fn(x)
    assert weights.requantized == requantized  # nothing changed since: no work


def test_options_refuse_bad_quantization_values():
    with pytest.raises(InvalidOptionError, match=r"quantization='int8' is invalid: must be None"):
        VitGraphOptions(quantization="int8", inner_compiler="inductor")
    with pytest.raises(InvalidOptionError, match="needs inner_compiler='inductor'"):
        VitGraphOptions(quantization="fp8", inner_compiler="eager")
    # the default, "auto", is Inductor on a GPU: accepted
    assert VitGraphOptions(quantization="fp8").inner_compiler_for(cuda=True) == "inductor"
    opts = VitGraphOptions(quantization="fp8", inner_compiler="inductor")
    assert opts.resolve(batched=True).budgets[0] == 1
    with pytest.raises(InvalidOptionError, match="packed towers"):
        opts.resolve((64, 4096))
    assert VitGraphOptions.from_dict(opts.to_dict()) == opts


def test_device_check_names_the_device_and_what_is_needed(monkeypatch):
    with pytest.raises(InvalidOptionError, match="needs a CUDA GPU with FP8 tensor cores.*cpu"):
        check_fp8_device(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(InvalidOptionError, match="NVIDIA A100 has 8.0"):
        check_fp8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device(torch.device("cuda", 0))  # Hopper: accepted


def test_backend_refuses_fp8_on_cpu_at_compile_time():
    model = _Mlp()
    fn = torch.compile(model, backend="vitgraph",
                       options={"quantization": "fp8", "inner_compiler": "inductor"})
    with pytest.raises(Exception, match="quantization='fp8' needs a CUDA GPU"):
        fn(torch.randn(2, 64))


@torch.no_grad()
def test_whole_backend_path_with_inductor_on_cpu(monkeypatch):
    """The option's real path (rewrite, Inductor, the batched encoder) with the device check
    doubled out: Dynamo's module metadata must not reach AOTAutograd with the new buffers."""
    import vit_graph_backend.backend as backend

    monkeypatch.setattr(backend, "check_fp8_device", lambda device: None)
    torch.compiler.reset()
    torch.manual_seed(3)
    model = _Mlp()
    fn = torch.compile(model, backend=backend.vitgraph,
                       options={"quantization": "fp8", "inner_compiler": "inductor"})
    for rows in (2, 5, 3):
        x = torch.randn(rows, 64)
        _assert_close_to_max(fn(x), _reference(model, x))
    _load_new_state(model)
    x = torch.randn(4, 64)
    _assert_close_to_max(fn(x), _reference(model, x))
    torch.compiler.reset()


@torch.no_grad()
def test_a_second_compile_comes_from_aotautograds_cache_and_reads_its_own_weights(
        tmp_path, monkeypatch):
    """``fp8_linear`` is a plain function in the graph, which AOTAutograd's cache passes by
    unless told it may take it (``_compat.mark_cacheable``): then a second process's compile comes
    from the cache. The FP8 weights are the graph's buffers, inputs of the cached code: another
    model of the same shapes, and new weights loaded after, give their own results."""
    from compile_caches import cache_outcomes

    import vit_graph_backend.backend as backend

    monkeypatch.setattr(backend, "check_fp8_device", lambda device: None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    counts = []
    for seed in (3, 4):  # a second model, other weights: the second compile's cache entry is the first's
        torch.compiler.reset()
        torch.manual_seed(seed)
        model = _Mlp()
        with cache_outcomes() as outcomes:
            fn = torch.compile(model, backend=backend.vitgraph,
                               options={"quantization": "fp8", "inner_compiler": "inductor"})
            for rows in (2, 5):
                x = torch.randn(rows, 64)
                _assert_close_to_max(fn(x), _reference(model, x))
        counts.append(outcomes)
    _load_new_state(model)
    x = torch.randn(4, 64)
    _assert_close_to_max(fn(x), _reference(model, x))
    torch.compiler.reset()
    assert counts[0].get("autograd_cache_bypass", 0) == 0 and counts[0], counts
    assert counts[1].get("autograd_cache_hit", 0) >= 1, counts


@torch.no_grad()
def test_threads_calling_after_a_weight_change_all_get_the_new_weights():
    import threading

    model, fn, weights, x = _quantized_after_one_call(4)
    _load_new_state(model)
    ref = _reference(model, x)
    outs, errors = [], []

    def call():
        try:
            with torch.no_grad():  # per thread: grad mode is thread-local (and a Dynamo guard)
                outs.append(fn(x))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(outs) == 8
    for out in outs:
        _assert_close_to_max(out, ref)
    assert 2 <= weights.requantized <= 16  # each stale weight at least once
