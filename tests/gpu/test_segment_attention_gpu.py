"""The Triton segment kernel (``adapters/_segment_attention.py``) on CUDA: against a float32
per-segment reference on the full-attention layout (q and k views of one buffer, v of another,
empty slots, blocks across segment ends, a padding segment), inside a captured CUDA graph whose
offsets change between replays, the per-budget timing against cuDNN or flash varlen, and served
Qwen2.5-VL towers whose full-attention layers run it, against HF and against flash varlen."""

from __future__ import annotations

import random

import pytest
import torch
from segment_operands import (
    _first_call_in_a_capture,
    _layout,
    _offsets,
    _reference,
    _served_errors,
)

from vit_graph_backend.kernels import _threaded_builds
from vit_graph_backend.kernels.attention_choice import AttentionChoice
from vit_graph_backend.kernels.segment_attention import (
    SegmentFlashAttention,
    segment_unserved_reason,
)
from vit_graph_backend.kernels._triton_calls import triton_reason

DEV = "cuda"


def _no_tma() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() < (9, 0):
        return "the segment kernel reads through TMA (compute capability 9.0+)"
    return triton_reason()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_no_tma() is not None, reason=f"{_no_tma()}")]


def _lengths(seed, slots=12):
    """Segment lengths of a packed batch: empty slots, lengths on and off the 64- and 128-row
    blocks, one long segment, and a padding segment last."""
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, 5, 63, 64, 65, 127, 128, 129, 300, 1000]) for _ in range(slots)]
    return [*lengths, rng.randint(1, 200)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# heads of 8 and 16 as the test towers have: a part 16 wide covers more than a head of 8
@pytest.mark.parametrize(("heads", "dim"), [(16, 80), (16, 72), (3, 64), (2, 96), (4, 128),
                                            (4, 8), (3, 16)])
@torch.no_grad()
def test_matches_a_float32_reference_on_the_full_attention_layout(heads, dim, dtype):
    kernel = SegmentFlashAttention()
    for seed in range(3):
        lengths = _lengths(seed * 100 + dim)
        gen = torch.Generator(device=DEV).manual_seed(seed)
        q, k, v = _layout(sum(lengths), heads, dim, dtype, gen)
        offsets = _offsets(lengths)
        assert segment_unserved_reason(q, k, v, offsets) is None
        out = kernel(q, k, v, offsets, sum(lengths), dim ** -0.5)
        assert out is not None, kernel.state
        ref = _reference(q, k, v, lengths, dim ** -0.5)
        err = (out.float() - ref).abs().max().item()
        from torch.nn.attention.varlen import varlen_attn
        longest = max(lengths)
        flash = varlen_attn(q, k, v, offsets, offsets, longest, longest).float()
        flash_err = (flash - ref).abs().max().item()
        print(f"segment kernel, {heads} heads of {dim}, {dtype}, segments {lengths}: max abs "
              f"error vs float32 {err:.3g} (flash varlen {flash_err:.3g})")
        assert out.shape == q.shape and out.is_contiguous()
        assert torch.isfinite(out).all() and err < 2e-2 and err <= 2 * flash_err + 1e-3
    assert kernel.state == {"compiled": 1, "refused": {}}


@torch.no_grad()
def test_a_captured_graph_follows_new_offsets_at_every_replay():
    """Compiled by a call outside the capture, captured once (two layers), then replayed with
    other segment lengths in the same offset buffer (same rows, same slots): each replay equals
    the reference."""
    heads, dim, rows, slots = 4, 80, 2048, 9
    gen = torch.Generator(device=DEV).manual_seed(3)
    q, k, v = _layout(rows, heads, dim, torch.bfloat16, gen)
    offsets = _offsets([rows] + [0] * (slots - 1))
    kernel = SegmentFlashAttention()
    assert kernel(q, k, v, offsets, rows, dim ** -0.5) is not None  # the warm-up compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(q, k, v, offsets, rows, dim ** -0.5)
        again = kernel(q, k, v, offsets, rows, dim ** -0.5)  # a second layer
    assert out is not None and again is not None
    rng = random.Random(7)
    for _ in range(4):
        cuts = sorted(rng.randint(0, rows) for _ in range(slots - 1))
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, rows], strict=True)]
        offsets.copy_(_offsets(lengths))
        graph.replay()
        torch.cuda.synchronize()
        ref = _reference(q, k, v, lengths, dim ** -0.5)
        for got in (out, again):
            err = (got.float() - ref).abs().max().item()
            assert err < 2e-2, (lengths, err)


@torch.no_grad()
def test_a_shape_met_first_inside_a_capture_is_left_to_the_other_kernels():
    kernel = SegmentFlashAttention()
    out = _first_call_in_a_capture(kernel, 80, [200, 56], 256)
    assert out is None and kernel.state == {"compiled": 0, "refused": {}}


@torch.no_grad()
def test_the_kernel_is_timed_per_budget_and_kept_only_where_faster():
    from torch.nn.attention.varlen import varlen_attn

    choice = AttentionChoice(None)
    for rows, frames in ((4096, 1), (4096, 4)):
        choice.prepare(rows, 16, 80, 80 ** -0.5, one_segment=frames == 1,
                       device=torch.device(DEV), dtype=torch.bfloat16, varlen=varlen_attn,
                       frames=frames)
        ms = choice.full_timings[rows]
        print(f"full attention, {rows} rows, {frames} frame slots: {ms} -> "
              f"{choice.full_by_rows[rows]} (against {choice.state['segments']})")
        expected = "triton" if ms["triton"] < ms["varlen"] else "varlen"
        assert choice.full_by_rows[rows] == expected
        assert (choice.graph_kernel(rows) is choice.ragged) == (expected == "varlen")
    assert AttentionChoice("varlen").segment is None


def _qwen2_5_tower():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    torch.manual_seed(0)
    # heads of 80, as the 3B tower's: the kernel's 64 + 16 split
    return Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(
        depth=4, hidden_size=160, intermediate_size=256, num_heads=2, out_hidden_size=96,
        window_size=112, fullatt_block_indexes=[1, 3])).to(DEV, torch.bfloat16).eval()


@pytest.mark.parametrize("chosen", ["forced", "timed"])
@torch.no_grad()
def test_served_qwen2_5_full_layers_match_hf_and_flash_varlen(monkeypatch, chosen):
    """A Qwen2.5-VL tower (heads of 80) served with the default attention, its full-attention
    kernel timed per budget at capture, or forced to the Triton segment kernel in every budget;
    outputs equal HF's and those of the tower served with ``packed_attention="varlen"`` within bf16
    rounding, over calls of one to three images."""
    pytest.importorskip("transformers")
    from vit_graph_backend import serve

    if chosen == "forced":  # wherever the kernel may run: not under packed_attention="varlen"
        monkeypatch.setattr(AttentionChoice, "_choose_segment_kernel",
                            lambda self, *args: "varlen" if self.segment is None else "triton")
    tower = _qwen2_5_tower()
    default, flash = serve(tower, max_budget=1024), serve(tower, max_budget=1024,
                                                          packed_attention="varlen")
    worst_hf, worst_flash = _served_errors(tower, default, flash, max_rows=1024)
    full = default.encoder.attention_state["full"]
    print(f"served qwen2.5 ({chosen}), full-attention kernels {full['by_rows']}, timings ms "
          f"{full['timings_ms']}, Triton {full['triton']}; max relative error vs HF "
          f"{worst_hf:.3g}, vs flash varlen {worst_flash:.3g}")
    assert worst_hf < 5e-2 and worst_flash < 5e-2
    assert len(full["by_rows"]) == default.manager.num_graphs > 0
    if chosen == "forced":
        assert set(full["by_rows"].values()) == {"triton"}
        assert full["triton"]["compiled"] >= 1 and full["triton"]["refused"] == {}
    else:
        for rows, ms in full["timings_ms"].items():  # a kernel that disagrees is never kept
            assert full["by_rows"][rows] == ("triton" if ms["triton"] < ms["varlen"]
                                             else "varlen")
    assert set(flash.encoder.attention_state["full"]["by_rows"].values()) == {"varlen"}
    assert default.manager.stats.eager_items == 0


def _compiles() -> int:
    from vit_graph_backend.kernels import _segment_attention_triton as K

    return sum(len(cache[0]) for cache in K._segment_attention.device_caches.values())


def _images(count, tokens=577, heads=2, dim=64, seed=0):
    """q, k, v of ``count`` images of ``tokens`` each as segments, and their offsets."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q, k, v = _layout(count * tokens, heads, dim, torch.bfloat16, gen)
    return (q, k, v), _offsets([tokens] * count), [tokens] * count


def _attends_right(out, qkv, lengths, scale):
    err = (out.float() - _reference(*qkv, lengths, scale)).abs().max().item()
    assert err < 2e-2, err


@torch.no_grad()
def test_one_compile_serves_every_segment_count_up_to_the_least_slots():
    """Segment counts of 1, a multiple of 16 and neither, up to ``MIN_SLOTS``: a kernel
    specialised on the count or scanning fewer slots would compile three to five times."""
    from vit_graph_backend.kernels import _segment_attention_triton as K

    config = (64, 32, 4, 3)  # launched by no other test: it compiles here
    before = _compiles()
    for count in (1, 2, 16, 17, K.MIN_SLOTS):
        qkv, offsets, lengths = _images(count, tokens=100, seed=count)
        out = K.attend(*qkv, offsets, 0.125, *config)
        _attends_right(out, qkv, lengths, 0.125)
    assert _compiles() - before == 1


@torch.no_grad()
def test_precompile_builds_each_configuration_so_the_launches_compile_nothing():
    from vit_graph_backend.kernels import _segment_attention_triton as K

    configs = [(64, 64, 4, 4), (128, 32, 4, 3)]  # launched by no other test
    qkv, offsets, lengths = _images(3, seed=21)
    before = _compiles()
    K.precompile(*qkv, offsets, 0.125, configs)
    built = _compiles()
    assert built - before == len(configs)
    for config in configs:
        _attends_right(K.attend(*qkv, offsets, 0.125, *config), qkv, lengths, 0.125)
    assert _compiles() == built


@torch.no_grad()
def test_precompile_leaves_a_configuration_that_cannot_build_to_fail_at_its_launch():
    from vit_graph_backend.kernels import _segment_attention_triton as K

    qkv, offsets, lengths = _images(2, dim=128, seed=22)
    too_big = (256, 256, 4, 6)  # megabytes of key and value stages: more than any GPU has
    K.precompile(*qkv, offsets, 0.125, [too_big, (128, 64, 4, 3)])  # returns; raises nothing
    with pytest.raises(Exception, match="out of resource"):
        K.attend(*qkv, offsets, 0.125, *too_big)
    _attends_right(K.attend(*qkv, offsets, 0.125), qkv, lengths, 0.125)


@torch.no_grad()
def test_precompile_without_threads_to_start_leaves_the_compiles_to_the_launches(monkeypatch):
    from vit_graph_backend.kernels import _segment_attention_triton as K

    class NoThreads:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(_threaded_builds, "ThreadPoolExecutor", NoThreads)
    qkv, offsets, lengths = _images(4, tokens=300, seed=23)
    configs = [(64, 64, 4, 3), (128, 64, 4, 3)]
    K.precompile(*qkv, offsets, 0.125, configs)  # returns; raises nothing
    for config in configs:
        _attends_right(K.attend(*qkv, offsets, 0.125, *config), qkv, lengths, 0.125)
