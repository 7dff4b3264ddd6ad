"""``epilogue_fusion`` on CPU: which Dynamo graph nodes the rewrite takes (HF CLIP's quick GELU,
exact and tanh GELU) and which it leaves, that a rewritten graph computes what the original did
(the op's PyTorch path runs here), the op's registration, and the option's checks. The Triton
kernels, the per-shape timing and captured graphs are ``tests/gpu/test_fused_linear*_gpu.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import vit_graph_backend
from vit_graph_backend import VitGraphOptions
from vit_graph_backend.errors import InvalidOptionError
from vit_graph_backend.kernels.fused_linear import (
    CHOICES,
    fused_epilogue_unavailable,
    gated_width,
    linear_act_reference,
    linear_silu_mul,
    linear_silu_mul_reference,
    pack_gated,
)
from vit_graph_backend.compile.linear_rewrite import fuse_linear_activations

DT = torch.bfloat16


class _Mlp(nn.Module):
    def __init__(self, act, width=32, hidden=64, bias=True):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(width, hidden, bias), nn.Linear(hidden, width), act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _QuickGelu(nn.Module):  # HF's QuickGELUActivation, written the two ways Python allows
    def __init__(self, scale_first=True, method=False):
        super().__init__()
        self.scale_first, self.method = scale_first, method

    def forward(self, y):
        scaled = 1.702 * y if self.scale_first else y * 1.702
        return y * (scaled.sigmoid() if self.method else torch.sigmoid(scaled))


def _rewrite(model, x):
    """Trace ``model`` with Dynamo, rewrite its graph; returns (count, original out, rewritten
    out, the rewritten graph's call targets)."""
    seen = {}

    def backend(gm, example_inputs):
        original = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())  # the graph before
        seen["original"] = original
        seen["count"] = fuse_linear_activations(gm, example_inputs)
        seen["targets"] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        seen["args"] = example_inputs
        return gm

    with torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(x)
        ref = seen["original"](*seen["args"])[0]   # Dynamo's graphs return a tuple
    return seen["count"], ref, out, seen["targets"]


OP = torch.ops.vitgraph.linear_act.default


@pytest.mark.parametrize("act, name", [
    (_QuickGelu(), "quick_gelu"),
    (_QuickGelu(scale_first=False, method=True), "quick_gelu"),
    (nn.GELU(), "gelu"),
    (nn.GELU(approximate="tanh"), "gelu_tanh"),
])
def test_linear_then_gelu_becomes_one_op_with_the_same_result(act, name):
    torch.manual_seed(0)
    model = _Mlp(act).to(DT).eval()
    count, ref, out, targets = _rewrite(model, torch.randn(3, 5, 32, dtype=DT))
    assert count == 1
    assert targets.count(OP) == 1 and targets.count(F.linear) == 1   # fc2 stays a linear
    assert not {torch.sigmoid, F.gelu} & set(targets)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)   # the same ops, on CPU


def test_hf_clip_every_mlp_is_rewritten_and_matches():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(0)
    model = transformers.CLIPVisionModel(cfg).to(DT).eval()
    count, ref, out, _ = _rewrite(lambda x: model(pixel_values=x).last_hidden_state,
                                  torch.randn(2, 3, 28, 28, dtype=DT))
    assert count == 3
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


class _Layer(nn.Module):
    """A residual MLP layer marked as a nested compile region: one graph for every layer."""

    def __init__(self):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(32), _Mlp(nn.GELU(approximate="tanh"))

    @torch.compiler.nested_compile_region
    def forward(self, x):
        return x + self.mlp(self.norm(x))


def _run_counted(fn, x, monkeypatch):
    """``fn`` through a backend that rewrites its graph; returns (the rewrite's count, how many
    times the op ran in the call, the output, the backend's graph, the layers it named)."""
    seen, named, ran = {}, [], []
    run = CHOICES.run
    monkeypatch.setattr(CHOICES, "run", lambda *args: ran.append(1) or run(*args))

    def backend(gm, example_inputs):
        seen["count"] = fuse_linear_activations(
            gm, example_inputs, lambda w, b, act: named.append((w, b, act)))
        seen["gm"] = gm
        return gm

    torch.compiler.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend=backend, fullgraph=True)(x)
    return seen["count"], len(ran), out, seen["gm"], named


def test_a_layer_in_a_nested_compile_region_is_rewritten_once_for_every_call(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(*[_Layer() for _ in range(3)]).to(DT).eval()
    x = torch.randn(4, 5, 32, dtype=DT)
    count, ran, out, gm, named = _run_counted(model, x, monkeypatch)
    regions = [m for m in gm.children() if isinstance(m, torch.fx.GraphModule)]
    assert len(regions) == 1   # the three layers share one graph
    targets = [n.target for n in regions[0].graph.nodes if n.op == "call_function"]
    assert targets.count(OP) == 1 and targets.count(F.linear) == 1   # fc1 + GELU; fc2 stays
    assert "linear_act" in regions[0].code   # the graph that runs, recompiled
    assert count == ran == 3   # one rewrite, run by each of the three layers
    first = model[0].mlp.fc1
    assert [(w is first.weight, b is first.bias, act) for w, b, act in named] == [
        (True, True, "gelu_tanh")]
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)   # the op's CPU path


@torch.compiler.nested_compile_region
def _gelu_layer(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


@torch.compiler.nested_compile_region
def _two_layers(x, w, b, w2):
    return F.linear(_gelu_layer(x, w, b), w2)


@pytest.mark.parametrize("case", ["computed weight first", "region inside a region"])
def test_the_count_is_how_often_the_rewritten_op_runs(case, monkeypatch):
    """A region's weight read from whichever call passes a graph input; one region graph
    called both from the graph and from inside another region counted at every call."""
    gen = torch.Generator().manual_seed(0)
    w, b = ([torch.randn(*shape, dtype=DT, generator=gen) for _ in range(3)]
            for shape in ((32, 32), (32,)))
    x = torch.randn(4, 32, dtype=DT, generator=gen)
    if case == "computed weight first":
        def fn(x):
            return _gelu_layer(_gelu_layer(x, w[0] * 1, b[0]), w[1], b[1])
    else:
        def fn(x):
            return _gelu_layer(_two_layers(x, w[0], b[0], w[1]), w[2], b[2])
    count, ran, out, _, named = _run_counted(fn, x, monkeypatch)
    assert count == ran == 2
    assert len(named) == 1 and named[0][0] is (w[1] if case == "computed weight first" else w[0])
    torch.testing.assert_close(out, fn(x), rtol=0, atol=0)


@pytest.mark.parametrize("case", ["fp32", "odd width", "other constant", "y read again",
                                  "erf-free gelu", "no activation"])
def test_what_the_rewrite_leaves_alone(case):
    torch.manual_seed(0)
    act, dtype, hidden = _QuickGelu(), DT, 64
    if case == "fp32":
        dtype = torch.float32            # the kernel runs 16-bit floats only
    elif case == "odd width":
        hidden = 60                      # N not a multiple of 8: no 16-byte descriptor stride
    elif case == "other constant":
        act = _Lambda(lambda y: y * torch.sigmoid(1.5 * y))
    elif case == "y read again":
        act = _Lambda(lambda y: y * torch.sigmoid(1.702 * y) + y)
    elif case == "erf-free gelu":
        act = _Lambda(lambda y: 0.5 * y * (1 + torch.tanh(0.79788456 * (y + 0.044715 * y ** 3))))
    elif case == "no activation":
        act = nn.Identity()
    model = _Mlp(act, hidden=hidden).to(dtype).eval()
    count, ref, out, targets = _rewrite(model, torch.randn(4, 32, dtype=dtype))
    assert count == 0 and OP not in targets
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


class _Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, y):
        return self.fn(y)


def test_the_op_has_a_fake_kernel_and_a_schema_torch_accepts():
    x, w, b = torch.randn(6, 16, dtype=DT), torch.randn(8, 16, dtype=DT), torch.randn(8, dtype=DT)
    before = CHOICES.state["chosen"]
    for bias in (b, None):
        torch.library.opcheck(OP, (x, w, bias, "quick_gelu"))
        torch.testing.assert_close(OP(x, w, bias, "gelu"), linear_act_reference(x, w, bias, "gelu"),
                                   rtol=0, atol=0)
    assert CHOICES.state["chosen"] == before   # CPU tensors never reach the timing


def test_pack_gated_alternates_chunks_of_gate_and_up_rows_and_pads_with_zeros():
    gate = torch.arange(200 * 3, dtype=torch.float32).view(200, 3) + 1
    up = -gate
    packed = pack_gated(gate, up)
    assert packed.shape == (512, 3) and gated_width(200) == 256 and gated_width(256) == 256
    torch.testing.assert_close(packed[:128], gate[:128])            # chunk 0: gate, then up
    torch.testing.assert_close(packed[128:256], up[:128])
    torch.testing.assert_close(packed[256:328], gate[128:])         # chunk 1: 72 real rows
    torch.testing.assert_close(packed[384:456], up[128:])
    assert not packed[328:384].any() and not packed[456:].any()
    biases = pack_gated(gate[:, 0], up[:, 0])
    torch.testing.assert_close(biases, packed[:, 0])


def test_the_gated_op_has_a_fake_kernel_and_computes_silu_gate_times_up():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 16, dtype=DT, generator=gen)
    gw, uw = (torch.randn(200, 16, dtype=DT, generator=gen) for _ in range(2))
    gb, ub = (torch.randn(200, dtype=DT, generator=gen) for _ in range(2))
    before = CHOICES.state["chosen"]
    for bias in (pack_gated(gb, ub), None):
        weight = pack_gated(gw, uw)
        torch.library.opcheck(torch.ops.vitgraph.linear_silu_mul.default, (x, weight, bias))
        gate, up = x.float() @ gw.float().T, x.float() @ uw.float().T
        if bias is not None:
            gate, up = gate + gb.float(), up + ub.float()
        expected = gate / (1 + torch.exp(-gate)) * up       # silu(gate) * up, the textbook way
        out = linear_silu_mul(x, weight, bias)
        assert out.shape == (2, 3, 256) and out.dtype == DT
        torch.testing.assert_close(out[..., :200].float(), expected, rtol=2e-2, atol=2e-2)
        assert not out[..., 200:].any()                   # the padding columns are zero
        torch.testing.assert_close(out, linear_silu_mul_reference(x, weight, bias), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"packed by pack_gated.*multiple of 256.*\(200, 16\)"):
        linear_silu_mul(x, gw, gb)
    assert CHOICES.state["chosen"] == before   # CPU tensors never reach the timing


def test_reference_activations_are_the_textbook_formulas():
    y = torch.linspace(-6, 6, 101, dtype=torch.float64)
    eye = torch.eye(101, dtype=torch.float64)
    torch.testing.assert_close(linear_act_reference(eye, y.diag(), None, "quick_gelu").diagonal(),
                               y / (1 + torch.exp(-1.702 * y)))
    torch.testing.assert_close(linear_act_reference(eye, y.diag(), None, "gelu").diagonal(),
                               0.5 * y * (1 + torch.erf(y / 2 ** 0.5)))
    tanh = 0.5 * y * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (y + 0.044715 * y ** 3)))
    torch.testing.assert_close(linear_act_reference(eye, y.diag(), None, "gelu_tanh").diagonal(),
                               tanh)


def test_option_is_checked_when_built():
    assert VitGraphOptions().epilogue_fusion == "auto"
    assert VitGraphOptions(epilogue_fusion="off").epilogue_fusion == "off"
    with pytest.raises(InvalidOptionError, match=r"epilogue_fusion='on' is invalid.*'auto', 'off'"):
        VitGraphOptions.from_compile_kwargs({"epilogue_fusion": "on"})


def test_cpu_graph_is_left_alone_and_says_why(caplog):
    assert "not a CUDA GPU" in fused_epilogue_unavailable(torch.device("cpu"))
    torch.manual_seed(0)
    model = _Mlp(_QuickGelu()).to(DT).eval()
    x = torch.randn(4, 32, dtype=DT)
    with caplog.at_level(logging.INFO, logger="vit_graph_backend"), torch.no_grad():
        out = torch.compile(model, backend="vitgraph")(x)
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    assert vit_graph_backend.report()["fused_linear_activations"] == 0
    assert any("epilogue_fusion='auto' leaves linear layers" in r.message and "cpu" in r.message
               for r in caplog.records)


def _timed_with(monkeypatch, failure):
    """``LinearActChoices._time`` with every fused candidate raising ``failure`` and cuBLAS +
    activation running: the timer only calls its work here (the graph timing is a GPU test)."""
    from vit_graph_backend.kernels import fused_linear

    def launch(choice, rows, weight, bias, activation):
        if choice != "cublas+activation":
            raise failure
        return rows

    monkeypatch.setattr(fused_linear.LinearActChoices, "_launch", staticmethod(launch))
    monkeypatch.setattr(fused_linear, "graph_ms", lambda fn, calls, reps: fn() is not None)
    choices = fused_linear.LinearActChoices()
    x, w = torch.ones(4, 8), torch.ones(8, 8)
    return choices, choices._time(x, w, None, "gelu")


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"),
                                   RuntimeError("CUDA error: out of memory")])
def test_a_candidate_out_of_memory_while_timed_is_not_refused(monkeypatch, error):
    choices, choice = _timed_with(monkeypatch, error)
    assert choice == "cublas+activation"
    assert choices.state["refused"] == {}   # tried again at the next shape


def test_a_candidate_that_fails_to_build_is_refused(monkeypatch):
    choices, choice = _timed_with(monkeypatch, RuntimeError("out of resources"))
    assert choice == "cublas+activation"
    assert set(choices.state["refused"].values()) == {"RuntimeError: out of resources"}


def test_out_of_memory_for_every_candidate_leaves_cublas(monkeypatch):
    from vit_graph_backend.kernels import fused_linear

    monkeypatch.setattr(fused_linear, "graph_ms", lambda fn, calls, reps: (_ for _ in ()).throw(
        torch.OutOfMemoryError("CUDA out of memory")))
    choices = fused_linear.LinearActChoices()
    assert choices._time(torch.ones(4, 8), torch.ones(8, 8), None, "gelu") == "cublas+activation"
    assert choices.state["refused"] == {}


def test_the_rewrite_names_each_rewritten_layer_s_weight_bias_and_activation():
    torch.manual_seed(0)
    model = nn.Sequential(_Mlp(nn.GELU()), _Mlp(_QuickGelu(), bias=False)).to(DT).eval()
    named = []

    def backend(gm, example_inputs):
        fuse_linear_activations(gm, example_inputs,
                                lambda w, b, act: named.append((w, b, act)))
        return gm

    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(torch.randn(3, 32, dtype=DT))
    first, second = model[0].fc1, model[1].fc1
    assert len(named) == 2  # the fc2 layers have no activation: not rewritten
    assert [(w is first.weight, b is first.bias, act) for w, b, act in named[:1]] == [
        (True, True, "gelu")]
    assert [(w is second.weight, b, act) for w, b, act in named[1:]] == [
        (True, None, "quick_gelu")]


class _Kernels:
    """A stand-in for ``_linear_act_triton`` whose ``precompile`` records its calls and, when
    told to, blocks until released."""

    def __init__(self, hold=False):
        import threading

        self.calls, self.release, self.done = [], threading.Event(), threading.Event()
        if not hold:
            self.release.set()

    def precompile(self, rows, weight, bias, activation, configs):
        self.calls.append((tuple(rows.shape), weight, bias, activation, list(configs)))
        self.release.wait(10)
        self.done.set()


def _prefetching(monkeypatch, kernels):
    from vit_graph_backend.kernels import fused_linear

    monkeypatch.setattr(fused_linear, "_kernels", lambda: (kernels, None))
    monkeypatch.setattr(fused_linear.LinearActChoices, "_fusable",
                        staticmethod(lambda rows, weight, bias: True))
    return fused_linear, fused_linear.LinearActChoices()


def test_prefetch_builds_a_weight_s_configurations_once_in_the_background(monkeypatch):
    kernels = _Kernels()
    fused_linear, choices = _prefetching(monkeypatch, kernels)
    w, b = torch.ones(16, 8, dtype=DT), torch.ones(16, dtype=DT)
    choices.refused[(False, fused_linear.FUSED_CONFIGS[0])] = "out of resources"
    choices.prefetch(w, b, "gelu")
    choices.prefetch(w, b, "gelu")            # the same shape again: no second build
    choices.prefetch(w, None, "gelu")         # without a bias: a kernel of its own
    choices.prefetch(w, b, "silu_mul")        # not an activation the rewrite makes: nothing
    assert kernels.done.wait(10)
    choices._builder.shutdown(wait=True)
    assert [(shape, weight is w, bias is b, act) for shape, weight, bias, act, _ in
            kernels.calls] == [((128, 8), True, True, "gelu"), ((128, 8), True, False, "gelu")]
    assert kernels.calls[0][-1] == list(fused_linear.FUSED_CONFIGS[1:])  # not the refused one


def test_the_timing_waits_for_the_weight_s_background_build(monkeypatch):
    import threading

    kernels = _Kernels(hold=True)
    fused_linear, choices = _prefetching(monkeypatch, kernels)
    order = []
    monkeypatch.setattr(fused_linear, "time_each", lambda *args, **kwargs: (
        order.append(("timed", kernels.done.is_set())) or ({"cublas+activation": 1.0}, {})))
    w = torch.ones(16, 8, dtype=DT)
    choices.prefetch(w, None, "gelu")
    timer = threading.Thread(target=choices._time, args=(torch.ones(4, 8, dtype=DT), w, None,
                                                         "gelu"))
    timer.start()
    timer.join(0.5)
    assert timer.is_alive() and order == []  # held by the build
    kernels.release.set()
    timer.join(10)
    assert order == [("timed", True)]


def test_prefetch_without_a_thread_to_start_leaves_the_compiles_to_the_timing(monkeypatch):
    kernels = _Kernels()
    fused_linear, choices = _prefetching(monkeypatch, kernels)

    class NoThreads:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(fused_linear, "ThreadPoolExecutor", NoThreads)
    choices.prefetch(torch.ones(16, 8, dtype=DT), None, "gelu")  # returns; raises nothing
    assert kernels.calls == [] and choices._builds == {}


def test_a_timing_waiting_for_calls_beside_a_preparation_does_not_hold_the_choices(monkeypatch):
    """A kernel timing captures, so it waits for the calls answered beside a background
    preparation (``capture._Gate``); such a call's own fused layers read the choices. The timing
    therefore runs without the choices' lock, or the two would wait for each other forever."""
    import contextlib
    import threading

    from vit_graph_backend.kernels import fused_linear
    from vit_graph_backend.runtime.capture import beside_captures, capturing

    timing, call_done = threading.Event(), threading.Event()

    def time_(self, rows, weight, bias, activation):
        timing.set()
        with capturing():   # waits for the call below to leave the gate
            return "cublas+activation"

    monkeypatch.setattr(fused_linear.LinearActChoices, "_fusable", staticmethod(lambda *a: True))
    monkeypatch.setattr(fused_linear.LinearActChoices, "_launch",
                        staticmethod(lambda choice, rows, weight, bias, act: rows @ weight.T))
    monkeypatch.setattr(fused_linear.LinearActChoices, "_time", time_)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    choices = fused_linear.LinearActChoices()
    w = torch.ones(8, 8)

    def call_beside():
        with beside_captures():
            timer.start()
            assert timing.wait(5)
            choices.run(torch.ones(3, 8), w, None, "gelu")   # another shape: reads the choices
        call_done.set()

    timer = threading.Thread(target=choices.run, args=(torch.ones(5, 8), w, None, "gelu"),
                             daemon=True)
    caller = threading.Thread(target=call_beside, daemon=True)
    caller.start()
    caller.join(10)
    timer.join(10)
    assert call_done.is_set() and not timer.is_alive()
    assert len(choices.chosen) == 1   # the call beside the timing ran cuBLAS, untimed
