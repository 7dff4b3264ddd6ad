"""The Qwen adapters' staged replay inputs (``adapters/_qwen_packing.py``): a batch's host-side
metadata is made once per (call's grids, batch's items, budget) and reused, while its pixel rows
always come from the call at hand.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (  # noqa: E402
    Qwen2_5_VLVisionConfig,
)
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (  # noqa: E402
    Qwen2_5_VisionTransformerPretrainedModel,
)
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig  # noqa: E402
from transformers.models.qwen2_vl.modeling_qwen2_vl import (  # noqa: E402
    Qwen2VisionTransformerPretrainedModel,
)

from vit_graph_backend.adapters import _qwen_packing, adapt  # noqa: E402
from vit_graph_backend.errors import UnsupportedGraphError  # noqa: E402

PATCH = 2
PATCH_DIM = 3 * 2 * PATCH * PATCH
CPU = torch.device("cpu")


def _adapter(window: bool):
    torch.manual_seed(0)
    if window:  # Qwen2.5-VL: rows gathered into window order
        tower = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(
            depth=2, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=24,
            patch_size=PATCH, window_size=2 * 2 * PATCH, fullatt_block_indexes=[1]))
    else:  # Qwen2-VL: rows taken as a contiguous range
        tower = Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(
            depth=1, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2, patch_size=PATCH))
    return adapt(tower.eval(), min_budget=4, max_budget=48)


def _inputs(grids, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(t * h * w for t, h, w in grids)
    return {"pixel_values": torch.randn(rows, PATCH_DIM, generator=gen),
            "grid_thw": torch.tensor(grids, dtype=torch.long)}


@pytest.mark.parametrize("window", [True, False], ids=["window order", "contiguous"])
def test_same_grids_reuse_the_metadata_but_take_the_new_pixels(window):
    adapter = _adapter(window)
    budget = 32
    adapter.prepare_encoder_cudagraph_capture_inputs(budget, 3, None, CPU, torch.float32)
    grids = [(1, 4, 6), (1, 2, 2), (1, 4, 4)]
    first_inputs, second_inputs = _inputs(grids, seed=1), _inputs(grids, seed=2)
    first = adapter.prepare_encoder_cudagraph_replay_buffers(first_inputs, [1, 2], budget)
    second = adapter.prepare_encoder_cudagraph_replay_buffers(second_inputs, [1, 2], budget)
    for key in first.keys() - {"pixel_values"}:
        assert second[key] is first[key], key  # staged once, reused
    # the pixel rows are the second call's own, in graph order: as the unstaged eager path has
    for inputs, values in ((first_inputs, first), (second_inputs, second)):
        exact, _ = adapter.packer.eager_values(inputs, [1, 2])
        assert torch.equal(values["pixel_values"], exact["pixel_values"])
    assert not torch.equal(first["pixel_values"], second["pixel_values"])
    # other items of the same call, or another budget, are staged on their own
    other = adapter.prepare_encoder_cudagraph_replay_buffers(first_inputs, [0, 1], budget)
    assert other["position_ids"] is not first["position_ids"]


def test_a_budget_captured_again_gets_metadata_padded_to_its_new_shapes():
    adapter = _adapter(window=True)
    grids, budget = [(1, 4, 6)], 32
    adapter.prepare_encoder_cudagraph_capture_inputs(budget, 3, None, CPU, torch.float32)
    first = adapter.prepare_encoder_cudagraph_replay_buffers(_inputs(grids, 0), [0], budget)
    static = adapter.prepare_encoder_cudagraph_capture_inputs(budget, 2, None, CPU,
                                                               torch.float32)
    second = adapter.prepare_encoder_cudagraph_replay_buffers(_inputs(grids, 0), [0], budget)
    assert second["frame_seqlens"] is not first["frame_seqlens"]
    assert first["frame_seqlens"].shape == (3,)
    assert second["frame_seqlens"].shape == static["frame_seqlens"].shape == (2,)


def test_staged_batches_are_bounded_and_a_refused_batch_is_not_staged(monkeypatch):
    monkeypatch.setattr(_qwen_packing, "STAGED_BATCHES", 3)
    adapter = _adapter(window=True)
    budget = 32
    adapter.prepare_encoder_cudagraph_capture_inputs(budget, 3, None, CPU, torch.float32)
    for side in (2, 4, 6, 8, 10):
        grids = [(1, 4, side)]
        adapter.prepare_encoder_cudagraph_replay_buffers(_inputs(grids, side), [0], budget)
    assert len(adapter.packer._staged) == 3
    too_big = [(1, 20, 20)]  # 100 tokens
    for _ in range(2):  # refused each time, never kept
        with pytest.raises(UnsupportedGraphError, match="100 tokens, more than budget 32"):
            adapter.prepare_encoder_cudagraph_replay_buffers(_inputs(too_big, 0), [0], budget)
    assert all(key[0] != tuple(too_big) for key in adapter.packer._staged)
