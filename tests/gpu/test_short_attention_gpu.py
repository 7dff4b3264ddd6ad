"""The short-segment attention kernel (``adapters/_short_attention.py``) on CUDA: against a
float32 per-segment reference on the window layers' layout (q and k views of one buffer, v of
another, empty slots, segments of 0 to 64 rows), inside a captured CUDA graph whose offsets change
between replays, the per-budget timing against flash varlen, and served Qwen2.5-VL towers whose
window layers run it, against HF and against flash varlen."""

from __future__ import annotations

import random

import pytest
import torch

from segment_operands import (DEV, _first_call_in_a_capture, _layout, _offsets, _reference,
                              _served_errors)

from vit_graph_backend.kernels.attention_choice import AttentionChoice
from vit_graph_backend.kernels.short_attention import ShortSegmentAttention, triton_reason

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(triton_reason() is not None, reason=f"{triton_reason()}")]


def _shuffled(lengths, seed, moves=200):
    """``lengths`` with rows moved between segments at random: same total, each 0 to 64."""
    rng, lengths = random.Random(seed), list(lengths)
    for _ in range(moves):
        i, j = rng.randrange(len(lengths)), rng.randrange(len(lengths))
        amount = rng.randint(0, min(lengths[i], 64 - lengths[j]))
        lengths[i] -= amount
        lengths[j] += amount
    return lengths


def _lengths(seed, count=40):
    rng = random.Random(seed)
    return [rng.choice([0, 0, 1, 2, 15, 16, 17, 33, 63, 64, 64]) for _ in range(count)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "dim"), [(16, 80), (16, 72), (2, 32), (3, 40), (4, 128)])
@torch.no_grad()
def test_matches_a_float32_reference_on_the_window_layout(heads, dim, dtype):
    lengths = _lengths(dim)
    rows = sum(lengths)
    gen = torch.Generator(device=DEV).manual_seed(dim)
    q, k, v = _layout(rows, heads, dim, dtype, gen)
    short = ShortSegmentAttention()
    out = short(q, k, v, _offsets(lengths), 64, dim ** -0.5)
    assert out is not None, short.state
    ref = _reference(q, k, v, lengths, dim ** -0.5)
    err = (out.float() - ref).abs().max().item()
    from torch.nn.attention.varlen import varlen_attn
    off = _offsets(lengths)
    flash_err = (varlen_attn(q, k, v, off, off, 64, 64).float() - ref).abs().max().item()
    print(f"short-segment kernel, {heads} heads of {dim}, {dtype}: max abs error vs float32 "
          f"{err:.3g} (flash varlen {flash_err:.3g})")
    assert out.shape == q.shape and out.is_contiguous()
    assert torch.isfinite(out).all() and err < 2e-2 and err <= 2 * flash_err + 1e-3
    assert short.state == {"compiled": 1, "refused": {}}


@torch.no_grad()
def test_a_captured_graph_follows_new_offsets_at_every_replay():
    """Compiled by a call outside the capture, captured once, then replayed with other segment
    lengths written into the same offset buffer: each replay equals the reference."""
    heads, dim, rows = 4, 80, 64 * 30
    gen = torch.Generator(device=DEV).manual_seed(3)
    q, k, v = _layout(rows, heads, dim, torch.bfloat16, gen)
    offsets = _offsets([64] * 30 + [0] * 10)
    short = ShortSegmentAttention()
    assert short(q, k, v, offsets, 64, dim ** -0.5) is not None  # the warm-up compiles it
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = short(q, k, v, offsets, 64, dim ** -0.5)
    assert out is not None
    for seed in range(3):
        lengths = _shuffled([64] * 30 + [0] * 10, seed)
        offsets.copy_(_offsets(lengths))
        graph.replay()
        torch.cuda.synchronize()
        err = (out.float() - _reference(q, k, v, lengths, dim ** -0.5)).abs().max().item()
        assert err < 2e-2, (seed, err)


@torch.no_grad()
def test_a_shape_met_first_inside_a_capture_is_left_to_flash_varlen():
    short = ShortSegmentAttention()
    out = _first_call_in_a_capture(short, 64, [64, 64], 64)
    assert out is None and short.state == {"compiled": 0, "refused": {}}


@torch.no_grad()
def test_out_of_memory_at_the_first_run_leaves_the_shape_to_be_compiled_at_the_next():
    """The real kernel, its first run failing as a full GPU would fail it: that call is left to
    flash varlen, and the next compiles and serves the shape (a failure of the kernel itself
    would be refused for the process: ``tests/unit/kernels/test_attention_choice.py``)."""
    import importlib

    kernel = importlib.import_module("vit_graph_backend.kernels._short_attention_triton")

    class FullOnce:
        failed = False

        def attend(self, *args):
            if not self.failed:
                self.failed = True
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return kernel.attend(*args)

    gen = torch.Generator(device=DEV).manual_seed(5)
    lengths = _lengths(5)
    q, k, v = _layout(sum(lengths), 4, 80, torch.bfloat16, gen)
    short = ShortSegmentAttention()
    short._kernel = FullOnce()
    assert short(q, k, v, _offsets(lengths), 64, 80 ** -0.5) is None
    out = short(q, k, v, _offsets(lengths), 64, 80 ** -0.5)
    assert out is not None and short.state == {"compiled": 1, "refused": {}}
    err = (out.float() - _reference(q, k, v, lengths, 80 ** -0.5)).abs().max().item()
    assert err < 2e-2


@torch.no_grad()
def test_the_window_kernel_is_timed_per_budget_and_kept_only_where_faster():
    from torch.nn.attention.varlen import varlen_attn

    choice = AttentionChoice(None)
    for rows in (1024, 4096):
        choice.prepare(rows, 16, 80, 80 ** -0.5, one_segment=False, device=torch.device(DEV),
                       dtype=torch.bfloat16, varlen=varlen_attn, windows=(64, rows // 16))
        ms = choice.window_timings[rows]
        print(f"window layers, {rows} rows: {ms} -> {choice.window_by_rows[rows]}")
        expected = "short" if ms["short"] < ms["varlen"] else "varlen"
        assert choice.window_by_rows[rows] == expected
        assert (choice.window_kernel(rows) is choice.short) == (expected == "short")
    assert AttentionChoice("varlen").short is None


@torch.no_grad()
def test_served_qwen2_5_window_layers_match_hf_and_flash_varlen():
    """A Qwen2.5-VL tower (heads of 32, 64-row windows) served with the default attention: each
    budget's window kernel is timed at capture; outputs equal HF's and those of the same tower
    served with ``packed_attention="varlen"`` (flash varlen in every layer) within bf16 rounding."""
    pytest.importorskip("transformers")
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    from vit_graph_backend import serve

    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(
        depth=4, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=96,
        window_size=112, fullatt_block_indexes=[1, 3])).to(DEV, torch.bfloat16).eval()
    default, flash = serve(tower, max_budget=512), serve(tower, max_budget=512,
                                                         packed_attention="varlen")
    worst_hf, worst_flash = _served_errors(tower, default, flash)
    windows = default.encoder.attention_state["windows"]
    print(f"served qwen2.5, window kernels {windows['by_rows']}, timings ms "
          f"{windows['timings_ms']}; max relative error vs HF {worst_hf:.3g}, vs flash varlen "
          f"{worst_flash:.3g}")
    assert worst_hf < 5e-2 and worst_flash < 5e-2
    assert len(windows["by_rows"]) == default.manager.num_graphs > 0
    assert windows["timings_ms"].keys() == windows["by_rows"].keys()
    for rows, ms in windows["timings_ms"].items():  # a kernel that disagrees is never kept
        assert windows["by_rows"][rows] == ("short" if ms["short"] < ms["varlen"] else "varlen")
    assert flash.encoder.attention_state["windows"]["by_rows"] == {
        rows: "varlen" for rows in windows["by_rows"]}
    assert default.manager.stats.eager_items == 0
