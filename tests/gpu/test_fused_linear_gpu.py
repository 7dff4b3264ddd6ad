"""``epilogue_fusion`` on CUDA: the Triton GEMM with bias and activation in its epilogue
(``_linear_act_kernels.py``) against a float32 reference in every tile configuration the op
times, the per-shape choice (timed outside captures, never inside one), the op inside a captured
CUDA graph replayed on new data, threads meeting new shapes together, and HF CLIP through
``torch.compile(backend="vitgraph")`` against eager with the rewrite on and off. Hopper or newer
(the kernel loads through the tensor memory accelerator)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import vit_graph_backend
from vit_graph_backend import _threaded_builds, fused_linear
from vit_graph_backend.fused_linear import (
    CHOICES,
    FUSED_CONFIGS,
    GATE_CHUNK,
    GATED,
    GATED_CONFIGS,
    linear_act_reference,
    linear_silu_mul_reference,
    pack_gated,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(fused_linear.fused_epilogue_unavailable(
                  torch.device("cuda")) is not None if torch.cuda.is_available() else False,
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


@pytest.mark.parametrize("activation", ["quick_gelu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("config", FUSED_CONFIGS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("bias", [True, False])
def test_fused_kernel_matches_fp32_reference(activation, config, bias):
    from vit_graph_backend import _linear_act_kernels as K

    # rows and N not multiples of any tile: the descriptors' edges are exercised
    x, w, b = _operands(3 * 577, 256, 392, bias=bias)
    out = K.linear_act(x, w, b, activation, config)
    assert out.shape == (3 * 577, 392) and out.dtype == DT
    _bf16_close(out, _fp32(x, w, b, activation))


@pytest.mark.parametrize("config", [(128, 128, 64, 3, 4, 0, 2), (64, 256, 64, 2, 4, 0, 2)],
                         ids=lambda c: "x".join(map(str, c)))
def test_two_programs_per_sm_walk_every_tile_once(config):
    """A seventh field launches that many persistent programs per SM: with more tiles than
    programs, each walks several, and every output tile is written once, right."""
    from vit_graph_backend import _linear_act_kernels as K

    x, w, b = _operands(20 * 577, 256, 392, bias=True)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    assert -(-x.shape[0] // config[0]) * -(-392 // config[1]) > config[6] * sms
    out = K.linear_act(x, w, b, "quick_gelu", config)
    _bf16_close(out, _fp32(x, w, b, "quick_gelu"))


def _compiles() -> int:
    from vit_graph_backend import _linear_act_kernels as K

    return sum(len(cache[0]) for cache in K._linear_act_kernel.device_caches.values())


def test_one_compile_of_a_configuration_serves_every_row_count():
    from vit_graph_backend import _linear_act_kernels as K

    # a configuration the choices never time, without bias and with the exact tanh: a variant
    # no other test launches, so it compiles here
    config = K.CONFIGS[-1]
    before = _compiles()
    # 577 and 1001 rows are not multiples of 16, 9232 is: a kernel specialised on the row
    # count would compile twice
    for rows in (577, 9232, 1001):
        x, w, b = _operands(rows, 128, 256, seed=rows, bias=False)
        _bf16_close(K.linear_act(x, w, b, "gelu_tanh", config, approx=False),
                    _fp32(x, w, b, "gelu_tanh"))
    assert _compiles() - before == 1


def test_precompile_builds_each_configuration_so_the_launches_compile_nothing():
    from vit_graph_backend import _linear_act_kernels as K

    # the exact tanh with quick GELU: a variant no other test launches, so it is compiled here
    x, w, b = _operands(2 * 577, 64, 256, seed=11)
    configs = FUSED_CONFIGS[:2]
    before = _compiles()
    K.precompile(x, w, b, "quick_gelu", configs, approx=False)
    built = _compiles()
    assert built - before == len(configs)
    for config in configs:
        _bf16_close(K.linear_act(x, w, b, "quick_gelu", config, approx=False),
                    _fp32(x, w, b, "quick_gelu"))
    assert _compiles() == built


def test_precompile_leaves_a_configuration_that_cannot_build_to_fail_at_its_launch():
    from vit_graph_backend import _linear_act_kernels as K

    x, w, b = _operands(300, 64, 256, seed=12)
    too_big = (256, 256, 128, 6, 8, 0)  # 768 KiB of operand stages: more than any GPU has
    K.precompile(x, w, b, "gelu", [too_big, FUSED_CONFIGS[0]])  # returns; raises nothing
    with pytest.raises(Exception, match="out of resource"):
        K.linear_act(x, w, b, "gelu", too_big)
    _bf16_close(K.linear_act(x, w, b, "gelu", FUSED_CONFIGS[0]), _fp32(x, w, b, "gelu"))


def test_precompile_without_threads_to_start_leaves_the_compiles_to_the_launches(monkeypatch):
    from vit_graph_backend import _linear_act_kernels as K

    class NoThreads:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(_threaded_builds, "ThreadPoolExecutor", NoThreads)
    x, w, b = _operands(700, 64, 256, seed=13)
    K.precompile(x, w, b, "gelu_tanh", FUSED_CONFIGS)  # returns; raises nothing
    for config in FUSED_CONFIGS:
        _bf16_close(K.linear_act(x, w, b, "gelu_tanh", config), _fp32(x, w, b, "gelu_tanh"))


def test_prefetch_builds_the_configurations_so_the_timing_compiles_nothing():
    choices = fused_linear.LinearActChoices()
    # K of 40 (not a multiple of 16) with exact GELU and no bias: a variant no other test
    # compiles
    x, w, b = _operands(2 * 577, 40, 264, seed=14, bias=False)
    before = _compiles()
    choices.prefetch(w, b, "gelu")
    (build,) = choices._builds.values()
    build.result(timeout=300)
    built = _compiles()
    assert built - before == len(FUSED_CONFIGS)
    choice = choices._time(x, w, b, "gelu")
    assert _compiles() == built
    _bf16_close(choices._launch(choice, x, w, b, "gelu"), _fp32(x, w, b, "gelu"))


def test_the_backend_begins_each_fused_shape_s_build_when_it_rewrites_the_graph(monkeypatch):
    began = []
    prefetch = CHOICES.prefetch
    monkeypatch.setattr(CHOICES, "prefetch",
                        lambda w, b, act: began.append((tuple(w.shape), b is not None, act))
                        or prefetch(w, b, act))
    torch.compiler.reset()
    _compiled_matches_eager(_clip(layers=2))
    # fc1 of each layer, at each Dynamo compile of the model (static, then dynamic)
    assert began and set(began) == {((1024, 256), True, "quick_gelu")}
    assert len(began) == 2 * vit_graph_backend.report()["compiles"]


@pytest.mark.parametrize("activation", ["quick_gelu", "gelu", "gelu_tanh"])
def test_separate_activation_kernel_matches(activation):
    from vit_graph_backend import _linear_act_kernels as K

    y = torch.randn(1001, 72, device=DEV, dtype=DT) * 4
    ref = linear_act_reference(torch.eye(72, device=DEV), y.float(), None, activation).t()
    _bf16_close(K.activation_(y.clone(), activation), ref)


def _gated_operands(rows, k, width, seed, bias=True):
    """x and the packed gate/up weight and bias (``pack_gated``) of a ``width``-wide MLP."""
    x, gw, gb = _operands(rows, k, width, seed=seed, bias=bias)
    _, uw, ub = _operands(rows, k, width, seed=seed + 100, bias=bias)
    return x, pack_gated(gw, uw), pack_gated(gb, ub) if bias else None


def _gated_fp32(x, weight, bias):
    return linear_silu_mul_reference(x.float(), weight.float(),
                                     None if bias is None else bias.float())


@pytest.mark.parametrize("config", GATED_CONFIGS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("bias", [True, False])
def test_gated_kernel_matches_fp32_reference(config, bias):
    from vit_graph_backend import _linear_act_kernels as K

    # 392 wide: packed to 2 x 512 rows, the last chunk partly padding; rows not a tile multiple
    x, w, b = _gated_operands(3 * 577, 256, 392, seed=11, bias=bias)
    out = K.linear_act(x, w, b, GATED, config)
    assert out.shape == (3 * 577, 512) and out.dtype == DT
    _bf16_close(out, _gated_fp32(x, w, b), roundings=4)
    assert not out[:, 392:].any()


def test_separate_silu_mul_kernel_matches():
    from vit_graph_backend import _linear_act_kernels as K

    y = torch.randn(1001, 2 * 384, device=DEV, dtype=DT) * 4
    ref = linear_silu_mul_reference(y.float(), torch.eye(2 * 384, device=DEV), None)
    _bf16_close(K.silu_mul_packed(y, GATE_CHUNK), ref, roundings=4)


@pytest.mark.parametrize("forced", [None, "cublas+activation", GATED_CONFIGS[0]],
                         ids=["timed", "unfused", "fused"])
def test_a_gated_shape_is_timed_once_and_replays_right_in_a_graph(forced, monkeypatch):
    x, w, b = _gated_operands(4 * 256 + 5, 128, 264, seed=15)
    if forced is not None:   # each way runs in the graph, whichever the timing would pick
        monkeypatch.setitem(CHOICES.chosen, (x.device.index, DT, x.shape[0], 128, 384, GATED,
                                             True), forced)
    key = f"cuda:{x.device.index} bfloat16 {x.shape[0]}x128 -> 384 silu_mul +bias"
    _bf16_close(GATED_OP(x, w, b), _gated_fp32(x, w, b), roundings=4)
    choice = CHOICES.state["chosen"][key]
    assert choice.split()[0] in ("fused", "cublas+activation")
    static = x.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = GATED_OP(static, w, b)
    for seed in (17, 18):
        static.copy_(_operands(static.shape[0], 128, 264, seed=seed)[0])
        g.replay()
        torch.cuda.synchronize()
        _bf16_close(captured, _gated_fp32(static, w, b), roundings=4)
    assert CHOICES.state["chosen"][key] == choice


def test_gated_operands_the_kernel_cannot_take_run_the_reference():
    _, w, b = _gated_operands(64, 128, 200, seed=19)
    strided = torch.randn(64, 256, device=DEV, dtype=DT)[:, ::2]   # not contiguous
    before = dict(CHOICES.state["chosen"])
    out = GATED_OP(strided, w, b)
    assert torch.equal(out, linear_silu_mul_reference(strided, w, b))   # PyTorch's ops ran
    assert CHOICES.state["chosen"] == before                            # never timed


def test_gated_fused_wins_at_qwen2_5_vl_large_images():
    """Qwen2.5-VL-3B's MLP at one 16,384-patch image: the probe measured the gated kernel
    faster than cuBLAS on the packed weight + the SiLU-mul kernel
    (``benchmarks/results/linear_act_probe_gated_*``); the timing must pick it."""
    x, w, b = _gated_operands(16384, 1280, 3420, seed=21)
    GATED_OP(x, w, b)
    key = f"cuda:{x.device.index} bfloat16 16384x1280 -> 3456 silu_mul +bias"
    assert CHOICES.state["chosen"][key].startswith("fused"), CHOICES.state["chosen"][key]


def test_a_shape_is_timed_once_outside_a_capture_and_replays_right():
    x, w, b = _operands(2 * 577 + 3, 128, 512, seed=1)
    key = f"cuda:{x.device.index} bfloat16 {x.shape[0]}x128 -> 512 quick_gelu +bias"
    out = OP(x, w, b, "quick_gelu")                       # timed here
    chosen = CHOICES.state["chosen"]
    assert key in chosen and chosen[key].split()[0] in ("fused", "cublas+activation")
    _bf16_close(out, _fp32(x, w, b, "quick_gelu"))
    static = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        OP(static, w, b, "quick_gelu")
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = OP(static, w, b, "quick_gelu")
    for seed in (2, 3):
        fresh = _operands(static.shape[0], 128, 512, seed=seed)[0]
        static.copy_(fresh)
        g.replay()
        torch.cuda.synchronize()
        _bf16_close(captured, _fp32(fresh, w, b, "quick_gelu"))
    assert CHOICES.state["chosen"][key] == chosen[key]


def test_a_shape_first_met_inside_a_capture_is_not_timed_there():
    x, w, b = _operands(777, 64, 256, seed=4)
    key = f"cuda:{x.device.index} bfloat16 777x64 -> 256 gelu +bias"
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        # warm the unfused kernels' compile outside the capture, at another shape
        OP(*_operands(16, 64, 256)[:3], "gelu")
        with torch.cuda.graph(g, stream=s):
            out = OP(x, w, b, "gelu")
    assert key not in CHOICES.state["chosen"]             # no event sync inside the capture
    g.replay()
    torch.cuda.synchronize()
    _bf16_close(out, _fp32(x, w, b, "gelu"))
    OP(x, w, b, "gelu")                                   # the next run outside times it
    assert key in CHOICES.state["chosen"]


def test_operands_the_descriptors_cannot_take_run_the_reference():
    x, w, b = _operands(64, 136, 256, seed=5)
    strided = torch.randn(64, 272, device=DEV, dtype=DT)[:, ::2]   # not contiguous
    shifted = torch.randn(64 * 136 + 1, device=DEV, dtype=DT)[1:].view(64, 136)  # 2-byte offset
    shifted.copy_(x)
    for operand in (strided, shifted):
        _bf16_close(OP(operand, w, b, "gelu_tanh"), _fp32(operand, w, b, "gelu_tanh"))


def test_threads_meeting_new_shapes_together_get_right_answers():
    def work(i):
        x, w, b = _operands(300 + 64 * i, 128, 256, seed=10 + i)
        for _ in range(3):
            out = OP(x, w, b, "quick_gelu")
        torch.cuda.synchronize()
        return out, _fp32(x, w, b, "quick_gelu")

    with ThreadPoolExecutor(4) as pool:   # a worker's exception is raised here
        results = list(pool.map(work, range(4)))
    for out, ref in results:
        _bf16_close(out, ref)


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


@pytest.mark.parametrize("epilogue_fusion", ["auto", "off"])
def test_hf_clip_through_vitgraph_matches_eager(epilogue_fusion):
    model = _clip()
    torch.compiler.reset()
    _compiled_matches_eager(model, epilogue_fusion=epilogue_fusion)
    report = vit_graph_backend.report()
    # each Dynamo compile of the model (static first call, then dynamic) rewrites its 4 MLPs
    assert report["fused_linear_activations"] == (
        4 * report["compiles"] if epilogue_fusion == "auto" else 0)
    assert report["stats"]["graph_replays"] >= 3
    if epilogue_fusion == "auto":  # both budgets' shapes were timed in their warm-up runs
        timed = [k for k in CHOICES.state["chosen"] if "x256 -> 1024 quick_gelu" in k]
        assert {k.split()[2].split("x")[0] for k in timed} >= {str(2 * 257), str(6 * 257)}
    torch.compiler.reset()


def test_fused_wins_where_the_probe_said_it_does():
    """CLIP ViT-L/14-336's fc1 at 48 images: the probe measured the fused kernel 1.3x faster
    than cuBLAS + the separate activation (``benchmarks/results/linear_act_probe_*``); the timing
    must pick it. A choice, not a speed: the figures live in the benchmark."""
    x, w, b = _operands(48 * 577, 1024, 4096, seed=6)
    OP(x, w, b, "quick_gelu")
    key = f"cuda:{x.device.index} bfloat16 {48 * 577}x1024 -> 4096 quick_gelu +bias"
    assert CHOICES.state["chosen"][key].startswith("fused"), CHOICES.state["chosen"][key]


def test_past_the_shape_cap_new_shapes_run_untimed_and_right(monkeypatch):
    monkeypatch.setattr(fused_linear, "MAX_TIMED_SHAPES", len(CHOICES.state["chosen"]))
    x, w, b = _operands(4321, 128, 256, seed=8)
    out = OP(x, w, b, "gelu")
    assert not any(k.startswith(f"cuda:{x.device.index} bfloat16 4321x") for k in
                   CHOICES.state["chosen"])
    _bf16_close(out, _fp32(x, w, b, "gelu"))


def test_kernels_that_fail_leave_the_shape_to_pytorch(monkeypatch):
    class Broken:   # every Triton kernel fails to build
        @staticmethod
        def linear_act(*args, **kwargs):
            raise RuntimeError("out of resources")

        activation_ = silu_mul_packed = linear_act

        @staticmethod
        def precompile(*args, **kwargs):  # as the real one: a failed build surfaces at launch
            return None

    monkeypatch.setattr(fused_linear, "_kernels", lambda: (Broken, None))
    choices = fused_linear.LinearActChoices()
    x, w, b = _operands(333, 64, 128, seed=9)
    out = choices.run(x, w, b, "quick_gelu")
    _, pw, pb = _gated_operands(333, 64, 128, seed=10)
    gated = choices.run(x, pw, pb, GATED)
    assert list(choices.state["chosen"].values()) == ["pytorch", "pytorch"]
    assert set(choices.state["refused"].values()) == {"RuntimeError: out of resources"}
    assert len(choices.state["refused"]) == len(FUSED_CONFIGS) + len(GATED_CONFIGS)
    _bf16_close(out, _fp32(x, w, b, "quick_gelu"))
    assert torch.equal(gated, linear_silu_mul_reference(x, pw, pb))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_the_ops_run_on_their_tensors_gpu_whichever_is_current():
    """Operands on ``cuda:1`` while ``cuda:0`` is current: the timing, the Triton launches and a
    captured graph all run on ``cuda:1`` (the op enters the tensors' device)."""
    from vit_graph_backend.graph_launch import capture_stream

    dev = torch.device("cuda", 1)
    x, w, b = (t.to(dev) for t in _operands(2 * 577, 256, 1024, seed=30))
    xg, wg, bg = (t.to(dev) for t in _gated_operands(1000, 256, 392, seed=31))
    with torch.cuda.device(0):
        out = OP(x, w, b, "quick_gelu")
        gated = GATED_OP(xg, wg, bg)
        assert out.device == dev and gated.device == dev
        _bf16_close(out, _fp32(x, w, b, "quick_gelu"))
        _bf16_close(gated, _gated_fp32(xg, wg, bg), roundings=4)
        chosen = CHOICES.state["chosen"]
        assert f"cuda:1 bfloat16 {2 * 577}x256 -> 1024 quick_gelu +bias" in chosen
        assert "cuda:1 bfloat16 1000x256 -> 512 silu_mul +bias" in chosen
        with torch.cuda.device(dev):   # a graph of dev's ops, captured with dev current
            g = torch.cuda.CUDAGraph()
            # on a stream of dev: torch.cuda.graph's default is the process's first capture's
            # device (graph_launch.capture_stream), cuda:0 after the tests before this one
            with torch.cuda.graph(g, stream=capture_stream(dev)):
                captured = GATED_OP(xg, wg, bg)
        xg.copy_(_operands(1000, 256, 392, seed=32)[0].to(dev))
        g.replay()
        torch.cuda.synchronize(dev)
        _bf16_close(captured, _gated_fp32(xg, wg, bg), roundings=4)
