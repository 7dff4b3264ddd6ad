"""``epilogue_fusion``'s kernels on CUDA: the Triton GEMM with bias and activation in its epilogue
(``kernels/_linear_act_triton.py``) against a float32 reference in every tile configuration the op
times, its compiles (one per configuration for every row count, built side by side, begun by the
graph rewrite), the separate activation kernels, and the gated (SiLU-mul) form's kernels and its
op in a captured graph. The op's per-shape choice: ``test_fused_linear_choices_gpu.py``. Hopper
or newer (the kernel loads through the tensor memory accelerator)."""

from __future__ import annotations


import pytest
import torch

from vit_graph_backend.kernels import _threaded_builds
from vit_graph_backend.kernels import fused_linear
from vit_graph_backend.kernels.fused_linear import (
    CHOICES,
    FUSED_CONFIGS,
    GATE_CHUNK,
    GATED,
    GATED_CONFIGS,
    linear_act_reference,
    linear_silu_mul_reference,
)
from linear_act_operands import (DEV, DT, FUSED_KERNEL_TESTS, GATED_OP, _bf16_close, _fp32,
                                 _gated_fp32, _gated_operands, _operands)

pytestmark = FUSED_KERNEL_TESTS


@pytest.mark.parametrize("activation", ["quick_gelu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("config", FUSED_CONFIGS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("bias", [True, False])
def test_fused_kernel_matches_fp32_reference(activation, config, bias):
    from vit_graph_backend.kernels import _linear_act_triton as K

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
    from vit_graph_backend.kernels import _linear_act_triton as K

    x, w, b = _operands(20 * 577, 256, 392, bias=True)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    assert -(-x.shape[0] // config[0]) * -(-392 // config[1]) > config[6] * sms
    out = K.linear_act(x, w, b, "quick_gelu", config)
    _bf16_close(out, _fp32(x, w, b, "quick_gelu"))


def _compiles() -> int:
    from vit_graph_backend.kernels import _linear_act_triton as K

    return sum(len(cache[0]) for cache in K._linear_act_kernel.device_caches.values())


def test_one_compile_of_a_configuration_serves_every_row_count():
    from vit_graph_backend.kernels import _linear_act_triton as K

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
    from vit_graph_backend.kernels import _linear_act_triton as K

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
    from vit_graph_backend.kernels import _linear_act_triton as K

    x, w, b = _operands(300, 64, 256, seed=12)
    too_big = (256, 256, 128, 6, 8, 0)  # 768 KiB of operand stages: more than any GPU has
    K.precompile(x, w, b, "gelu", [too_big, FUSED_CONFIGS[0]])  # returns; raises nothing
    with pytest.raises(Exception, match="out of resource"):
        K.linear_act(x, w, b, "gelu", too_big)
    _bf16_close(K.linear_act(x, w, b, "gelu", FUSED_CONFIGS[0]), _fp32(x, w, b, "gelu"))


def test_precompile_without_threads_to_start_leaves_the_compiles_to_the_launches(monkeypatch):
    from vit_graph_backend.kernels import _linear_act_triton as K

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


@pytest.mark.parametrize("activation", ["quick_gelu", "gelu", "gelu_tanh"])
def test_separate_activation_kernel_matches(activation):
    from vit_graph_backend.kernels import _linear_act_triton as K

    y = torch.randn(1001, 72, device=DEV, dtype=DT) * 4
    ref = linear_act_reference(torch.eye(72, device=DEV), y.float(), None, activation).t()
    _bf16_close(K.activation_(y.clone(), activation), ref)


@pytest.mark.parametrize("config", GATED_CONFIGS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("bias", [True, False])
def test_gated_kernel_matches_fp32_reference(config, bias):
    from vit_graph_backend.kernels import _linear_act_triton as K

    # 392 wide: packed to 2 x 512 rows, the last chunk partly padding; rows not a tile multiple
    x, w, b = _gated_operands(3 * 577, 256, 392, seed=11, bias=bias)
    out = K.linear_act(x, w, b, GATED, config)
    assert out.shape == (3 * 577, 512) and out.dtype == DT
    _bf16_close(out, _gated_fp32(x, w, b), roundings=4)
    assert not out[:, 392:].any()


def test_separate_silu_mul_kernel_matches():
    from vit_graph_backend.kernels import _linear_act_triton as K

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
    (``benchmarks/results/qwen2_5_vl_3b_gated_mlp_kernel_time_H100_torch2.11.0.txt``); the timing
    must pick it."""
    x, w, b = _gated_operands(16384, 1280, 3420, seed=21)
    GATED_OP(x, w, b)
    key = f"cuda:{x.device.index} bfloat16 16384x1280 -> 3456 silu_mul +bias"
    assert CHOICES.state["chosen"][key].startswith("fused"), CHOICES.state["chosen"][key]
