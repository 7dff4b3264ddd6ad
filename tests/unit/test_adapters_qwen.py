"""Qwen-VL adapters against the HF towers they wrap, on tiny random configs, float32, CPU.

Three properties, for Qwen2-VL, Qwen2.5-VL (window attention plus a full-attention block) and
Qwen3-VL (deepstack):

1. ``adapter(pixel_values, grid_thw)`` equals the HF module's own eager output (``pooler_output``,
   plus ``deepstack_features`` for Qwen3-VL) for several images and videos per call.
2. A *reference dispatch*, written here with ``plan_batches`` and the protocol methods only (the
   runtime does the same), gives every item the output HF gives it alone: several batches per
   call, oversize items run eagerly, static buffers poisoned with NaN before each copy.
3. Capture and replay buffers fit each other: fixed shapes per budget, a replay buffer never
   longer than its capture buffer.

Tolerances: the eager path runs HF's own per-segment SDPA and matches bit for bit (checked at
``EAGER_ATOL``); the graph path on CPU uses a block-diagonal masked SDPA over the padded budget,
which reorders float32 sums: max abs error measured ~5e-6 on outputs of magnitude ~10
(``GRAPH_ATOL = 5e-5``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    adapter_for,
    register_adapter,
    supported_classes,
)
from vit_graph_backend.adapters._qwen_packing import ROW_INDEX  # noqa: E402
from vit_graph_backend.adapters._staging import BLOCK  # noqa: E402
from vit_graph_backend.adapters.qwen_families import (  # noqa: E402
    Qwen2_5_VLVisionAdapter,
    Qwen2VLVisionAdapter,
)
from vit_graph_backend.budgets import BudgetConfig  # noqa: E402
from vit_graph_backend.errors import (  # noqa: E402
    InvalidInputError,
    InvalidOptionError,
    UnsupportedGraphError,
    UnsupportedModelError,
)
from vit_graph_backend.planner import plan_batches  # noqa: E402
from vit_graph_backend.protocol import supports_encoder_cudagraph  # noqa: E402
from vit_graph_backend.graph_capture import BudgetGraph  # noqa: E402
from vit_graph_backend.replay_io import write_inputs  # noqa: E402
from vit_graph_backend.testing import image_grids  # noqa: E402

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


# --------------------------------------------------------------------------- eager equivalence
GRID_SETS = {
    "one image": [(1, 4, 6)],
    "images of several sizes": [(1, 4, 6), (1, 2, 2), (1, 10, 6), (1, 8, 8)],
    "videos": [(2, 4, 4), (3, 6, 2)],
    "mixed": [(1, 6, 6), (2, 2, 4), (1, 2, 10), (3, 4, 4)],
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("grids", GRID_SETS.values(), ids=GRID_SETS.keys())
def test_forward_matches_hf(towers, family, grids):
    hf, adapter = towers[family]
    inputs = _inputs(grids, seed=len(grids))
    with torch.no_grad():
        expected = _hf(hf, inputs["pixel_values"], inputs["grid_thw"])
        actual = _as_tuple(adapter(inputs["pixel_values"], inputs["grid_thw"]))
    _assert_close(actual, expected, EAGER_ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_forward_hook_inside_the_tower_runs_through_its_own_forward(towers, family):
    """The adapter runs a block's parts itself, so a block's forward hook would not run: with one
    registered, the adapter's eager path is the tower's own forward, its output in the
    adapter's layout, for all items or some of them in any order."""
    hf, adapter = towers[family]
    inputs = _inputs(GRID_SETS["mixed"], seed=3)

    def hook(module, args, output):  # a shift that differs across features
        return output + torch.linspace(-1.0, 1.0, output.shape[-1])

    with torch.no_grad():
        plain = _hf(hf, inputs["pixel_values"], inputs["grid_thw"])
        handle = hf.blocks[0].register_forward_hook(hook)
        try:
            expected = _hf(hf, inputs["pixel_values"], inputs["grid_thw"])
            actual = _as_tuple(adapter(inputs["pixel_values"], inputs["grid_thw"]))
            per_item = _hf_per_item(hf, inputs)
            some = _as_tuple(adapter.encoder_eager_forward(inputs, [2, 0]))
        finally:
            handle.remove()
        after = _as_tuple(adapter(inputs["pixel_values"], inputs["grid_thw"]))
    assert not torch.allclose(expected[0], plain[0], atol=1e-3)
    _assert_close(actual, expected, EAGER_ATOL)
    _assert_close(some, tuple(torch.cat([per_item[i][k] for i in (2, 0)])
                              for k in range(len(expected))), EAGER_ATOL)
    _assert_close(after, plain, EAGER_ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_forward_patched_on_a_block_class_runs_through_the_towers_own_forward(towers, family):
    """A block class's ``forward`` patched (to record or change its output) is code the
    adapter's own would skip: the adapter's eager path is then the tower's own forward
    (``code_watch.py``), and its own code again once the patch is undone."""
    hf, adapter = towers[family]
    inputs = _inputs(GRID_SETS["mixed"], seed=4)
    block = type(hf.blocks[0])
    original = block.forward

    def patch(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        return out + torch.linspace(-1.0, 1.0, out.shape[-1])

    with torch.no_grad():
        plain = _hf(hf, inputs["pixel_values"], inputs["grid_thw"])
        block.forward = patch
        try:
            expected = _hf(hf, inputs["pixel_values"], inputs["grid_thw"])
            actual = _as_tuple(adapter(inputs["pixel_values"], inputs["grid_thw"]))
        finally:
            block.forward = original
        after = _as_tuple(adapter(inputs["pixel_values"], inputs["grid_thw"]))
    assert not torch.allclose(expected[0], plain[0], atol=1e-3)
    _assert_close(actual, expected, EAGER_ATOL)
    _assert_close(after, plain, EAGER_ATOL)


grid_lists = st.lists(image_grids(patch=PATCH, merge=MERGE, max_side=PATCH * MERGE * 6,
                                  max_frames=3), min_size=1, max_size=5)


@FAST
@given(grids=grid_lists, seed=st.integers(0, 2**16))
def test_forward_matches_hf_random_grids(towers, grids, seed):
    inputs = _inputs(grids, seed)
    for hf, adapter in towers.values():
        with torch.no_grad():
            expected = _hf(hf, inputs["pixel_values"], inputs["grid_thw"])
            actual = _as_tuple(adapter(inputs["pixel_values"], inputs["grid_thw"]))
        _assert_close(actual, expected, EAGER_ATOL)


# --------------------------------------------------------------------------- graph equivalence
@st.composite
def dispatch_cases(draw):
    """A call and a budget config: images only without a frame cap (capture assumes one frame
    per item then), videos only with one."""
    frame_cap = draw(st.none() | st.integers(3, 8))
    max_frames = 1 if frame_cap is None else 3
    grids = draw(st.lists(image_grids(patch=PATCH, merge=MERGE, max_side=PATCH * MERGE * 8,
                                      max_frames=max_frames), min_size=1, max_size=6))
    config = BudgetConfig.resolve((MIN_BUDGET, MAX_BUDGET),
                                  max_batch_size=draw(st.none() | st.integers(1, MIN_BUDGET)),
                                  max_frames_per_batch=frame_cap)
    return grids, config, draw(st.integers(0, 2**16))


@FAST
@given(case=dispatch_cases())
def test_reference_dispatch_matches_hf_per_item(towers, case):
    grids, config, seed = case
    inputs = _inputs(grids, seed)
    for hf, adapter in towers.values():
        with torch.no_grad():
            expected = _hf_per_item(hf, inputs)
            _, actual = reference_dispatch(adapter, inputs, config)
        for a, e in zip(actual, expected, strict=True):
            _assert_close(a, e, GRAPH_ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_full_attention_for_one_item_budgets_matches_hf(towers, family):
    """``attention="dense"``: budgets of one slot (one single-frame image per batch) run full
    attention as one dense SDPA call with the padding keys hidden (``key_masked_attention``);
    every image still gets HF's output, while a budget of two slots keeps segment attention."""
    hf, _ = towers[family]
    adapter = adapt(hf, min_budget=MIN_BUDGET, max_budget=MAX_BUDGET, attention="dense")
    grids = [(1, 4, 6), (1, 2, 2), (1, 10, 6), (1, 8, 8)]
    inputs = _inputs(grids, seed=11)
    one = BudgetConfig.resolve((MIN_BUDGET, MAX_BUDGET), max_batch_size=1)
    with torch.no_grad():
        expected = _hf_per_item(hf, inputs)
        _, actual = reference_dispatch(adapter, inputs, one)
    for a, e in zip(actual, expected, strict=True):
        _assert_close(a, e, GRAPH_ATOL)
    chosen = adapter.attention_state["by_rows"]
    assert chosen and set(chosen.values()) == {"dense"}, chosen
    two = BudgetConfig.resolve((MIN_BUDGET, MAX_BUDGET), max_batch_size=2)
    static = adapter.prepare_encoder_cudagraph_capture_inputs(
        two.budgets[-1], 2, None, torch.device("cpu"), torch.float32)
    assert adapter.attention_state["by_rows"][static["pixel_values"].shape[0]] == "varlen"


@pytest.mark.parametrize("family", FAMILIES)
def test_dispatch_with_several_batches_and_an_oversize_item(towers, family):
    hf, adapter = towers[family]
    # 70 tokens > MAX_BUDGET runs eagerly; the rest needs several batches of <= 2 items.
    grids = [(1, 4, 4), (1, 20, 14), (1, 2, 2), (2, 4, 6), (1, 8, 8), (1, 2, 6), (1, 6, 6)]
    config = BudgetConfig.resolve((MIN_BUDGET, MAX_BUDGET), max_batch_size=2,
                                  max_frames_per_batch=4)
    inputs = _inputs(grids, seed=7)
    with torch.no_grad():
        plan, actual = reference_dispatch(adapter, inputs, config)
        expected = _hf_per_item(hf, inputs)
    assert plan.eager_items == (1,)
    assert len(plan.graph_batches) >= 3
    assert any(len(b.segments) == 2 for b in plan.graph_batches)
    for a, e in zip(actual, expected, strict=True):
        _assert_close(a, e, GRAPH_ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_item_output_does_not_depend_on_its_batch(towers, family):
    _, adapter = towers[family]
    grids = [(1, 6, 4), (2, 4, 4), (1, 2, 2)]
    inputs = _inputs(grids, seed=3)
    config = BudgetConfig.resolve((MIN_BUDGET, MAX_BUDGET), max_batch_size=3,
                                  max_frames_per_batch=6)
    with torch.no_grad():
        _, packed = reference_dispatch(adapter, inputs, config)
        for i, grid in enumerate(grids):
            alone_inputs = {"pixel_values": inputs["pixel_values"][
                sum(t * h * w for t, h, w in grids[:i]):][:grid[0] * grid[1] * grid[2]],
                "grid_thw": torch.tensor([grid])}
            _, (alone,) = reference_dispatch(adapter, alone_inputs, config)
            _assert_close(packed[i], alone, GRAPH_ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_buffers_have_fixed_shapes_per_budget(towers, family):
    _, adapter = towers[family]
    config = BudgetConfig.resolve((MIN_BUDGET, MAX_BUDGET), max_batch_size=3,
                                  max_frames_per_batch=5)
    for budget in config.budgets:
        first, second = (adapter.prepare_encoder_cudagraph_capture_inputs(
            budget, config.max_batch_size, config.max_frames_per_batch, torch.device("cpu"),
            torch.float32) for _ in range(2))
        assert {k: v.shape for k, v in first.items()} == {k: v.shape for k, v in second.items()}
        assert first["pixel_values"].shape[0] >= budget * MERGE * MERGE
        with torch.no_grad():
            out = _as_tuple(adapter.encoder_cudagraph_forward(first))
        assert all(o.shape[0] >= budget and torch.isfinite(o).all() for o in out)


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_metadata_comes_padded_to_the_captured_shapes(towers, family):
    """After a budget's capture, its replay metadata has the capture buffers' exact shapes with
    zero tails (padded on the host, ``adapters/_staging.py``; on CUDA copied to the GPU once,
    without a sync); the pixel rows stay unpadded (the runtime pads them on the device)."""
    _, adapter = towers[family]
    budget = 32
    static = adapter.prepare_encoder_cudagraph_capture_inputs(budget, 3, 5, torch.device("cpu"),
                                                               torch.float32)
    grids = [(1, 4, 6), (1, 2, 2)]
    inputs = _inputs(grids, seed=1)
    values = adapter.prepare_encoder_cudagraph_replay_buffers(inputs, [0, 1], budget)
    exact = adapter.packer.eager_values(inputs, [0, 1])[0]  # the same items, unpadded
    assert set(values) == {"pixel_values"}
    assert values["pixel_values"].shape == exact["pixel_values"].shape
    # the metadata comes as the whole block of the static block's layout: one copy
    loaded = values.load()
    assert loaded.keys() == {BLOCK} and BLOCK in static
    for key, block in loaded.items():
        assert block.shape == static[key].shape and block.dtype == static[key].dtype
    write_inputs(BudgetGraph(budget, static), values)
    for key in static.keys() - {"pixel_values", ROW_INDEX}:  # the eager path has no ROW_INDEX
        if key == BLOCK:
            continue
        n = exact[key].shape[0]
        assert torch.equal(static[key][:n], exact[key]), key
        assert not static[key][n:].any(), key


def test_videos_beyond_the_captured_frames_are_refused(towers):
    _, adapter = towers["qwen2"]
    config = BudgetConfig.resolve((MIN_BUDGET, MAX_BUDGET), max_batch_size=2)  # no frame cap
    adapter.prepare_encoder_cudagraph_capture_inputs(32, 2, None, torch.device("cpu"),
                                                      torch.float32)
    inputs = _inputs([(3, 2, 2), (1, 2, 2)], seed=0)
    assert config.max_frames_per_batch is None
    with pytest.raises(UnsupportedGraphError, match="4 frames .* captured for 2 frames"):
        adapter.prepare_encoder_cudagraph_replay_buffers(inputs, [0, 1], 32)
    with pytest.raises(UnsupportedGraphError, match="4 tokens, more than budget 3"):
        adapter.prepare_encoder_cudagraph_replay_buffers(inputs, [0, 1], 3)


# --------------------------------------------------------------------------- metadata vs HF
@settings(max_examples=40, deadline=None)
@given(grids=st.lists(image_grids(patch=PATCH, merge=MERGE, max_side=PATCH * MERGE * 9,
                                  max_frames=3), min_size=1, max_size=4))
def test_metadata_matches_hf_helpers(towers, grids):
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_position_ids,
        get_vision_window_index,
    )

    grid_thw = torch.tensor(grids)
    hf, adapter = towers["qwen2_5"]
    meta = adapter.packer.pack(grids, range(len(grids)))
    window_index, cu_window = get_vision_window_index(
        grid_thw, MERGE, hf.config.window_size, PATCH)
    unit = MERGE * MERGE
    assert torch.equal(meta.row_index.reshape(-1, unit)[:, 0] // unit, window_index)
    assert meta.window_offsets == cu_window.tolist()
    assert meta.frame_offsets == get_vision_cu_seqlens(grid_thw).tolist()
    positions = get_vision_position_ids(grid_thw, MERGE)
    assert torch.equal(meta.values["position_ids"], positions[meta.row_index])
    assert torch.equal(meta.values["reverse_index"], torch.argsort(window_index))


# --------------------------------------------------------------------------- configuration
def test_graph_unsupported_reason_for_training_mode(towers):
    hf, adapter = towers["qwen3"]
    assert adapter.graph_unsupported_reason() is None
    adapter.train()
    try:
        assert "training mode" in adapter.graph_unsupported_reason()
    finally:
        adapter.eval()
    assert not hf.training


def test_adapters_reuse_the_tower_weights(towers):
    for hf, adapter in towers.values():
        assert adapter.tower is hf
        hf_params = {id(p) for p in hf.parameters()}
        assert {id(p) for p in adapter.parameters()} == hf_params
        assert supports_encoder_cudagraph(adapter)


def test_budget_range_defaults_and_options():
    qwen2 = _qwen2().eval()
    # a 224 px square image: (224 // (patch * merge)) ** 2 tokens
    assert adapt(qwen2).get_encoder_cudagraph_budget_range() == (3136, 4096)  # patch 2
    real_patch = Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(
        depth=1, embed_dim=16, hidden_size=16, num_heads=2, mlp_ratio=1))
    assert adapt(real_patch).get_encoder_cudagraph_budget_range() == (64, 4096)
    qwen3 = Qwen3VLVisionModel(Qwen3VLVisionConfig(
        depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=8,
        deepstack_visual_indexes=[]))
    assert adapt(qwen3).get_encoder_cudagraph_budget_range() == (49, 4096)  # patch 16
    assert adapt(qwen2, min_budget=16, max_budget=256).get_encoder_cudagraph_budget_range() == (
        16, 256)
    with pytest.raises(InvalidOptionError, match="min_budget=512 is larger than max_budget=256"):
        adapt(qwen2, min_budget=512, max_budget=256)
    with pytest.raises(InvalidOptionError, match="did you mean 'max_budget'"):
        adapt(qwen2, max_budgte=256)
    with pytest.raises(InvalidOptionError, match="max_budget=0"):
        adapt(qwen2, max_budget=0)


def test_bad_inputs_are_rejected_with_the_numbers(towers):
    _, adapter = towers["qwen2"]
    with pytest.raises(InvalidInputError, match=r"grid_thw\[0\]=\[1, 3, 4\]"):
        adapter.get_encoder_cudagraph_item_specs({"grid_thw": torch.tensor([[1, 3, 4]])})
    inputs = _inputs([(1, 2, 4)], seed=0)
    inputs["pixel_values"] = inputs["pixel_values"][:-1]
    with pytest.raises(InvalidInputError, match=r"expected \(8, 24\)"):
        adapter.encoder_eager_forward(inputs, [0])


def test_unsupported_model_lists_supported_classes():
    with pytest.raises(UnsupportedModelError, match="Supported classes") as info:
        adapt(torch.nn.Linear(2, 2))
    assert isinstance(info.value, TypeError)
    assert "vit_graph_backend.protocol.SupportsEncoderCudaGraph" in str(info.value)
    for name in supported_classes():
        assert name in str(info.value)
    assert len(supported_classes()) == 6


def test_adapt_returns_protocol_models_unchanged(towers):
    _, adapter = towers["qwen2"]
    assert adapt(adapter) is adapter
    with pytest.raises(InvalidOptionError, match="implements SupportsEncoderCudaGraph itself"):
        adapt(adapter, max_budget=8)


def test_register_adapter_for_a_subclass():
    class MyTower(Qwen2_5_VisionTransformerPretrainedModel):
        pass

    tower = randomize_weights(MyTower(_qwen2_5().config), seed=0)
    with pytest.raises(UnsupportedModelError):
        adapt(tower)  # exact class match: a subclass may change forward
    register_adapter(MyTower, Qwen2_5_VLVisionAdapter)
    assert adapter_for(tower) is Qwen2_5_VLVisionAdapter
    assert isinstance(adapt(tower), Qwen2_5_VLVisionAdapter)
    with pytest.raises(InvalidOptionError, match="module:attribute"):
        register_adapter(MyTower, "no_colon")
    with pytest.raises(InvalidOptionError, match="wraps .*Qwen2VisionTransformerPretrainedModel"):
        Qwen2VLVisionAdapter(tower)


def test_a_registered_subclass_runs_on_its_own_code_and_a_later_patch_is_found():
    """Registering a subclass says the adapter's code is its own: its ``forward`` override is
    the user's code but not a patch (the adapter serves it, no eager batch); a function set on
    it afterwards is one (``code_watch.vouch``)."""
    import vit_graph_backend as vg

    class LoggingTower(Qwen2_5_VisionTransformerPretrainedModel):
        def forward(self, *args, **kwargs):  # the same math, in the user's code
            return super().forward(*args, **kwargs)

    hf = randomize_weights(LoggingTower(_qwen2_5().config), seed=0)
    register_adapter(LoggingTower, Qwen2_5_VLVisionAdapter)
    served = vg.serve(hf, min_budget=MIN_BUDGET, max_budget=MAX_BUDGET)
    inputs = _inputs(GRID_SETS["images of several sizes"], seed=5)
    with torch.no_grad():
        _assert_close(_as_tuple(served(inputs["pixel_values"], inputs["grid_thw"])),
                      _hf(hf, inputs["pixel_values"], inputs["grid_thw"]), GRAPH_ATOL)
    assert served.manager.stats.eager_batches == 0
    own = LoggingTower.forward
    LoggingTower.forward = lambda self, *args, **kwargs: own(self, *args, **kwargs)
    assert served.encoder.watch.hooked().startswith("LoggingTower.forward set to <lambda> (")
    LoggingTower.forward = own
    assert served.encoder.watch.hooked() is None


def test_importing_adapters_does_not_import_transformers():
    code = ("import sys, vit_graph_backend.adapters as a; a.supported_classes(); "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_function_traces_without_graph_breaks(towers, family):
    """``encoder_cudagraph_forward`` has no ``.item()``/``.tolist()`` or data-dependent Python
    control flow: Dynamo traces it in one graph (``fullgraph=True`` raises on any break)."""
    _, adapter = towers[family]
    values = adapter.prepare_encoder_cudagraph_capture_inputs(16, 2, 2, torch.device("cpu"),
                                                              torch.float32)
    compiled = torch.compile(adapter.encoder_cudagraph_forward, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(values), adapter.encoder_cudagraph_forward(values))


@pytest.mark.parametrize("family", FAMILIES)
def test_runtime_serves_the_adapters(towers, family):
    """The package's own runtime (CPU: plan, pad, run the captured function, slice) with the
    adapter gives each item HF's output for it alone."""
    hf, adapter = towers[family]
    manager = _serve_mixed_call(hf, adapter)
    stats = manager.stats.as_dict()
    assert stats["graph_replays"] + stats["no_graph_batches"] >= 2 and stats["eager_items"] == 1


MIXED_CALL = [(1, 4, 4), (1, 20, 14), (2, 4, 6), (1, 2, 2), (1, 6, 6)]


def _serve_mixed_call(hf, adapter):
    """Run ``MIXED_CALL`` (images, a video, an item over the largest budget) through the
    package's runtime on CPU and check each item against HF's output for it alone."""
    from vit_graph_backend.options import VitGraphOptions
    from vit_graph_backend.runtime import EncoderCudaGraphManager

    manager = EncoderCudaGraphManager(adapter, VitGraphOptions(
        max_items_per_graph=2, max_frames_per_batch=4))
    inputs = _inputs(MIXED_CALL, seed=5)
    with torch.no_grad():
        actual = manager.run(inputs)
        expected = _hf_per_item(hf, inputs)
    for a, e in zip(actual, expected, strict=True):
        _assert_close(_as_tuple(a), e, GRAPH_ATOL)
    return manager


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_of_q_and_k_together_equals_hf(dtype):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    from vit_graph_backend.adapters._fused import rotate_qk
    from vit_graph_backend.adapters.qwen_vl import _signed_sin

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(11, 3, 16, generator=gen).to(dtype) for _ in range(2))
    cos, sin = (torch.randn(11, 16, generator=gen) for _ in range(2))
    ref_q, ref_k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    cos4, sin4 = cos[:, None, None, :], _signed_sin(sin[:, None, None, :])
    got_q, got_k = rotate_qk(torch.stack([q, k, torch.zeros_like(q)], 1), cos4, sin4)
    assert got_q.dtype == dtype
    torch.testing.assert_close(got_q, ref_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, ref_k, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_graph_path_matches_hf_and_compiles_each_function_once(towers, family,
                                                                       monkeypatch):
    """``fuse=True``: the graph path calls the compiled block functions (a counting backend
    stands in for Inductor), once compiled for every budget; the eager path never calls them;
    outputs equal HF's."""
    from vit_graph_backend.adapters import _fused, _qwen_kernels

    compiles: list[str] = []

    def backend(gm, example_inputs):
        compiles.append(gm.code)
        return gm

    torch.compiler.reset()
    compiled = _fused.Ops(compiled=True, backend=backend)
    monkeypatch.setattr(_qwen_kernels, "ops", lambda on: compiled if on else _fused.ops(False))
    hf, _ = towers[family]
    adapter = adapt(hf, min_budget=MIN_BUDGET, max_budget=MAX_BUDGET, fuse=True)
    manager = _serve_mixed_call(hf, adapter)
    padded = manager.stats.as_dict()
    assert padded["graph_replays"] + padded["no_graph_batches"] >= 2
    inputs = _inputs(MIXED_CALL, seed=5)
    used = {"rotate_qk"} | ({"add_rms_norm"} if family != "qwen2" else {"add_layer_norm"})
    assert len(compiles) >= len(used), compiles
    assert len(compiles) <= len(used) + 1, "a function recompiled for another budget"
    n = len(compiles)
    with torch.no_grad():
        adapter(inputs["pixel_values"], inputs["grid_thw"])  # eager: no compiled calls
    assert len(compiles) == n
    assert adapter.fusion_state["fuse"] is True and compiled.failures() == {}


def test_fuse_option_is_validated_and_reported(towers):
    hf, _ = towers["qwen2_5"]
    with pytest.raises(InvalidOptionError, match="fuse='yes'"):
        adapt(hf, fuse="yes")
    adapter = adapt(hf, min_budget=MIN_BUDGET, max_budget=MAX_BUDGET)
    values = adapter.prepare_encoder_cudagraph_capture_inputs(16, 2, 2, torch.device("cpu"),
                                                              torch.float32)
    with torch.no_grad():
        adapter.encoder_cudagraph_forward(values)
    state = adapter.fusion_state
    assert state["fuse"] is None and "CUDA" in state["unavailable"]["cpu"]


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3"])
def test_compiled_served_tower_traces_the_compute_once_and_never_the_routing(towers, family,
                                                                            monkeypatch):
    """``torch.compile(serve(tower, inner_compiler=...), backend="vitgraph")``: the routing frame
    runs outside Dynamo (the vitgraph backend compiles nothing), and ``encoder_cudagraph_forward``
    is traced once for every budget (its row dimensions symbolic), not once per budget shape. A
    counting backend stands in for Inductor; outputs equal HF's per item."""
    from vit_graph_backend import packed
    from vit_graph_backend.backend import vitgraph

    traced: list[list[tuple[int, ...]]] = []

    def counting(gm, example_inputs):
        traced.append([tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)])
        return gm

    monkeypatch.setattr(packed, "inner_backend", lambda options: counting)
    torch.compiler.reset()
    hf, _ = towers[family]
    served = packed.PackedGraphEncoder(adapt(hf, min_budget=MIN_BUDGET, max_budget=MAX_BUDGET),
                                       inner_compiler="inductor", max_items_per_graph=2,
                                       max_frames_per_batch=4)
    compiled = torch.compile(served, backend="vitgraph")
    grid_sets = [[(1, 4, 4)], [(1, 8, 6), (1, 2, 2)], [(1, 10, 10)], [(2, 4, 4), (1, 6, 6)],
                 [(1, 4, 4)], [(1, 12, 8)], [(1, 2, 2), (1, 2, 4)]]
    with torch.no_grad():
        for k, grids in enumerate(grid_sets):
            inputs = _inputs(grids, seed=20 + k)
            got = compiled(inputs["pixel_values"], inputs["grid_thw"])
            expected = _hf(hf, inputs["pixel_values"], inputs["grid_thw"])
            _assert_close(_as_tuple(got), expected, GRAPH_ATOL)
    used = served.manager.stats.as_dict()["batches_per_budget"]
    assert len(used) >= 4, used  # the stream really spans several budget shapes
    assert len(traced) == 1, [shapes[0] for shapes in traced]
    assert vitgraph.report()["compiles"] == 0


def test_mlps_run_their_first_half_as_one_op_where_fusion_is_on(towers, monkeypatch):
    """Towers whose MLP is ``fc2(gelu(fc1 x))`` run ``fc1`` + GELU through ``fused_linear``'s
    ``linear_act`` op on the graph path with fusion on, gated MLPs (Qwen2.5-VL) their
    ``silu(gate x) * up x`` through ``linear_silu_mul`` on the packed copy (``align_mlp=True``
    has the copies on CPU too; on CPU the ops compute with PyTorch's ops, so the output still
    equals HF's); the eager path never calls them."""
    from vit_graph_backend import fused_linear

    expected = {"qwen2": "quick_gelu", "qwen2_5": "silu_mul", "qwen3": "gelu_tanh"}
    calls: list[str] = []
    run = fused_linear.CHOICES.run

    def counting(x, weight, bias, activation):
        calls.append(activation)
        return run(x, weight, bias, activation)

    monkeypatch.setattr(fused_linear.CHOICES, "run", counting)
    for family, epilogue in expected.items():
        hf, _ = towers[family]
        adapter = adapt(hf, min_budget=MIN_BUDGET, max_budget=MAX_BUDGET, fuse=True,
                        align_mlp=True)
        assert adapter.kernels.epilogue == epilogue, family
        calls.clear()
        _serve_mixed_call(hf, adapter)   # checks the served output against HF's
        depth = len(hf.blocks)
        assert calls and set(calls) == {epilogue} and len(calls) % depth == 0, (family, calls)
        calls.clear()
        with torch.no_grad():   # the eager path: the tower's own modules
            adapter(*_inputs(MIXED_CALL, seed=5).values())
        assert calls == [], family


def test_epilogue_fusion_off_reaches_the_adapter_through_serve(towers):
    from vit_graph_backend import VitGraphOptions, serve

    hf, _ = towers["qwen3"]
    on = serve(hf, min_budget=MIN_BUDGET, max_budget=MAX_BUDGET)
    off = serve(hf, min_budget=MIN_BUDGET, max_budget=MAX_BUDGET, epilogue_fusion="off")
    via_options = serve(hf, VitGraphOptions(min_budget=MIN_BUDGET, max_budget=MAX_BUDGET,
                                            epilogue_fusion="off"))
    assert on.encoder.kernels.epilogue == "gelu_tanh"
    assert off.encoder.kernels.epilogue is None and via_options.encoder.kernels.epilogue is None
    assert off.manager.options.epilogue_fusion == "off"
    with pytest.raises(InvalidOptionError, match="epilogue_fusion='never'"):
        adapt(hf, epilogue_fusion="never")


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5"])
def test_capture_asks_for_a_window_kernel_only_for_towers_with_windows(towers, family,
                                                                        monkeypatch):
    """Each budget's capture hands the attention choice its window layout (rows of a full
    window, window slots) where the tower has window layers, so their kernel is timed on it."""
    _, adapter = towers[family]
    asked = []
    monkeypatch.setattr(adapter.attention, "_choose_window_kernel",
                        lambda rows, *args: asked.append((rows, args[3])) or "varlen")
    static = adapter.prepare_encoder_cudagraph_capture_inputs(16, 2, 2, torch.device("cpu"),
                                                               torch.float32)
    rows = static["pixel_values"].shape[0]
    if family == "qwen2":
        assert asked == [] and rows not in adapter.attention.window_by_rows
    else:
        window_rows = adapter.layout.window_rows
        assert window_rows == 16  # 2 x 2 merged tokens of 4 rows
        assert asked == [(rows, (window_rows, adapter.packer.captured_slots[16].windows))]
        assert adapter.attention.window_by_rows[rows] == "varlen"
