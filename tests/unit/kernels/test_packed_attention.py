"""Packed attention paths and the segment offsets the Qwen adapters hand to them.

The CUDA path (``varlen_attn``) cannot run here, so what it relies on is checked on the offsets
themselves: after any replay copy into the static buffers, the offsets the captured function
builds start at 0, never decrease, end at the buffer's row count (every row, padding included, is
in a segment and is written), keep each real item's segments unchanged, and no segment is longer
than the ``max_seqlen`` passed with them. The masked path (CPU graph path) is compared with the
per-segment loop (HF's own path), zero-length segments included.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from qwen_towers import FAMILIES, MAX_BUDGET, MERGE, MIN_BUDGET, PATCH, _inputs  # noqa: E402

from vit_graph_backend.adapters import adapt  # noqa: E402
from vit_graph_backend.kernels.packed_attention import (  # noqa: E402
    Segments,
    masked_attention,
    packed_attention,
    segment_loop_attention,
)
from vit_graph_backend.budgets import BudgetConfig  # noqa: E402
from vit_graph_backend.runtime.capture import BudgetGraph  # noqa: E402
from vit_graph_backend.planner import plan_batches  # noqa: E402
from vit_graph_backend.runtime.replay_io import write_inputs  # noqa: E402
from vit_graph_backend.testing import image_grids  # noqa: E402


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6).filter(lambda x: sum(x) > 0),
       seed=st.integers(0, 2**16))
def test_masked_attention_equals_per_segment_attention(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(lengths)
    q, k, v = (torch.randn(rows, 2, 8, generator=gen) for _ in range(3))
    offsets = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    expected = segment_loop_attention(q, k, v, offsets.tolist(), scale=8 ** -0.5)
    actual = masked_attention(q, k, v, offsets, scale=8 ** -0.5)
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)


def test_cpu_never_calls_varlen():
    def varlen(*args):
        raise AssertionError("varlen_attn must not run on CPU")

    q = torch.randn(5, 2, 8)
    offsets = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    for host in (None, [0, 2, 2, 5]):
        out = packed_attention(q, q, q, Segments(offsets, 5, host), 8 ** -0.5, varlen)
        assert out.shape == q.shape and torch.isfinite(out).all()


def _check_offsets(segments: Segments, rows: int, real: list[int]) -> None:
    offsets = segments.offsets.tolist()
    assert segments.offsets.dtype == torch.int32
    assert offsets[0] == 0 and offsets[-1] == rows
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    assert min(lengths) >= 0 and max(lengths) <= segments.max_seqlen
    nonzero = [n for n in lengths if n]
    real_nonzero = [n for n in real if n]
    assert nonzero[:len(real_nonzero)] == real_nonzero  # real segments first, unchanged
    assert sum(nonzero) == rows


@pytest.fixture(scope="module")
def adapters():
    return {name: adapt(build().eval(), min_budget=MIN_BUDGET, max_budget=MAX_BUDGET)
            for name, build in FAMILIES.items() if name != "qwen3"}  # qwen3 segments = qwen2's


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grids=st.lists(image_grids(patch=PATCH, merge=MERGE, max_side=PATCH * MERGE * 7,
                                  max_frames=3), min_size=1, max_size=6),
       max_batch_size=st.integers(1, MIN_BUDGET), frame_cap=st.integers(3, 9))
def test_static_offsets_cover_every_row(adapters, grids, max_batch_size, frame_cap):
    config = BudgetConfig.resolve((MIN_BUDGET, MAX_BUDGET), max_batch_size=max_batch_size,
                                  max_frames_per_batch=frame_cap)
    inputs = _inputs(grids, seed=0)
    for adapter in adapters.values():
        specs = adapter.get_encoder_cudagraph_item_specs(inputs)
        for batch in plan_batches(specs, config).graph_batches:
            static = adapter.prepare_encoder_cudagraph_capture_inputs(
                batch.budget, config.max_batch_size, config.max_frames_per_batch,
                torch.device("cpu"), torch.float32)
            replay = adapter.prepare_encoder_cudagraph_replay_buffers(
                inputs, batch.items, batch.budget)
            write_inputs(BudgetGraph(batch.budget, static), replay)  # what a replay writes
            replay = dict(static)
            rows = static["pixel_values"].shape[0]
            full, window = adapter.packer.segments(static, None)
            assert full.max_seqlen == rows and full.host_offsets is None
            _check_offsets(full, rows, replay["frame_seqlens"].tolist())
            if window is not None:
                assert window.max_seqlen == min(adapter.layout.window_rows, rows)
                _check_offsets(window, rows, replay["window_seqlens"].tolist())
