"""Tiny random Qwen-VL vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5,
Qwen3.5-MoE; float32, CPU) with an adapter over each, and the helpers the Qwen adapter tests share:
HF's own outputs per call and per item, and a reference dispatch that does what the runtime does
with the protocol methods only (``tests/unit/adapters/test_qwen*.py``)."""

from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, settings

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
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig  # noqa: E402
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel  # noqa: E402

from toy_encoders import randomize_weights  # noqa: E402
from vit_graph_backend.adapters import (  # noqa: E402
    adapt,
)
from vit_graph_backend.adapters.staging import BLOCK  # noqa: E402
from vit_graph_backend.budgets import BudgetConfig  # noqa: E402
from vit_graph_backend.planner import plan_batches  # noqa: E402
from vit_graph_backend.runtime.capture import BudgetGraph  # noqa: E402
from vit_graph_backend.runtime.replay_io import write_inputs  # noqa: E402

PATCH, MERGE = 2, 2
PATCH_DIM = 3 * 2 * PATCH * PATCH
EAGER_ATOL = 1e-5
GRAPH_ATOL = 5e-5
MIN_BUDGET, MAX_BUDGET = 4, 48
FAST = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _qwen2() -> torch.nn.Module:
    return Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(
        depth=2, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2, patch_size=PATCH))


def _qwen2_5() -> torch.nn.Module:
    # window_size 8 px = 2 merged tokens a side: small grids still span several windows.
    return Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(
        depth=3, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=24,
        patch_size=PATCH, window_size=2 * MERGE * PATCH, fullatt_block_indexes=[1]))


def _qwen3() -> torch.nn.Module:
    return Qwen3VLVisionModel(Qwen3VLVisionConfig(
        depth=3, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=24,
        patch_size=PATCH, num_position_embeddings=16, deepstack_visual_indexes=[0, 2]))


def _qwen3_moe() -> torch.nn.Module:
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import (
        Qwen3VLMoeVisionConfig,
    )
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    return Qwen3VLMoeVisionModel(Qwen3VLMoeVisionConfig(
        depth=2, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=24,
        patch_size=PATCH, num_position_embeddings=16, deepstack_visual_indexes=[1]))


def _qwen3_5() -> torch.nn.Module:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    return Qwen3_5VisionModel(Qwen3_5VisionConfig(
        depth=3, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=24,
        patch_size=PATCH, num_position_embeddings=16))


def _qwen3_5_moe() -> torch.nn.Module:
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import (
        Qwen3_5MoeVisionConfig,
    )
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    return Qwen3_5MoeVisionModel(Qwen3_5MoeVisionConfig(
        depth=2, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=24,
        patch_size=PATCH, num_position_embeddings=16))


FAMILIES = {"qwen2": _qwen2, "qwen2_5": _qwen2_5, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe,
            "qwen3_5": _qwen3_5, "qwen3_5_moe": _qwen3_5_moe}


@pytest.fixture(scope="module")
def towers() -> dict[str, tuple[torch.nn.Module, torch.nn.Module]]:
    """family -> (HF tower, adapter over it)."""
    result = {}
    for seed, (name, build) in enumerate(FAMILIES.items()):
        hf = randomize_weights(build(), seed)
        result[name] = (hf, adapt(hf, min_budget=MIN_BUDGET, max_budget=MAX_BUDGET))
    return result


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _hf(model, pixel_values, grid_thw) -> tuple[torch.Tensor, ...]:
    """The HF module's per-token merged output(s) for the LLM: pooler_output (+ deepstack)."""
    out = model(pixel_values, grid_thw)
    return (out.pooler_output, *(getattr(out, "deepstack_features", None) or ()))


def _inputs(grids, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = sum(t * h * w for t, h, w in grids)
    return {"pixel_values": torch.randn(rows, PATCH_DIM, generator=gen),
            "grid_thw": torch.tensor(grids, dtype=torch.long).reshape(-1, 3)}


def _hf_per_item(model, inputs) -> list[tuple[torch.Tensor, ...]]:
    """Each item run alone through the HF module."""
    outs, row = [], 0
    for grid in inputs["grid_thw"]:
        rows = int(grid.prod())
        outs.append(_hf(model, inputs["pixel_values"][row:row + rows], grid[None]))
        row += rows
    return outs


def _assert_close(actual, expected, atol: float) -> float:
    worst = 0.0
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert a.shape == e.shape
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, e, atol=atol, rtol=1e-5)
        worst = max(worst, float((a - e).abs().max()) if a.numel() else 0.0)
    return worst


def _written_through(buffers, written, key):
    """Whether ``buffers[key]`` was written: itself, or the block whose storage it views."""
    ptr = buffers[key].untyped_storage().data_ptr()
    return key in written or any(buffers[w].untyped_storage().data_ptr() == ptr
                                 for w in written)


def reference_dispatch(adapter, inputs, config: BudgetConfig, poison: bool = True):
    """What the runtime does, in a few lines: plan; per graph batch copy the replay buffers into
    the budget's static buffers (head copied, tail zeroed) and run the captured function; slice
    each item's rows; run oversize items eagerly; restore the caller's order."""
    specs = adapter.get_encoder_cudagraph_item_specs(inputs)
    plan = plan_batches(specs, config)
    static: dict[int, dict[str, torch.Tensor]] = {}
    per_item = []
    for batch in plan.batches:
        if batch.eager:
            out = adapter.encoder_eager_forward(inputs, batch.items)
        else:
            if batch.budget not in static:
                static[batch.budget] = adapter.prepare_encoder_cudagraph_capture_inputs(
                    batch.budget, config.max_batch_size, config.max_frames_per_batch,
                    torch.device("cpu"), torch.float32)
            buffers = static[batch.budget]
            replay = adapter.prepare_encoder_cudagraph_replay_buffers(
                inputs, batch.items, batch.budget)
            if poison:  # stale garbage from a shared pool must never reach real rows
                for key, buf in buffers.items():  # the block's bytes: through its views
                    if key != BLOCK:
                        buf.fill_(float("nan") if buf.is_floating_point() else 10**6)
            entry = BudgetGraph(batch.budget, buffers)  # a fresh one: it writes every buffer
            write_inputs(entry, replay)
            # every buffer the graph reads was written (a block writes the views it holds)
            read = buffers.keys() - {BLOCK}
            assert all(_written_through(buffers, entry.written, k) for k in read), entry.written
            out = adapter.encoder_cudagraph_forward(buffers)
            assert all(o.shape[0] >= batch.budget for o in _as_tuple(out))
        row = 0
        for seg in batch.segments:
            per_item.append(tuple(o[row:row + seg.tokens] for o in _as_tuple(out)))
            row += seg.tokens
    return plan, plan.restore(per_item)


#: Calls of several items each (t, h, w per item, in patches).
GRID_SETS = {
    "one image": [(1, 4, 6)],
    "images of several sizes": [(1, 4, 6), (1, 2, 2), (1, 10, 6), (1, 8, 8)],
    "videos": [(2, 4, 4), (3, 6, 2)],
    "mixed": [(1, 6, 6), (2, 2, 4), (1, 2, 10), (3, 4, 4)],
}
