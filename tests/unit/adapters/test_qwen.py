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


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")


from vit_graph_backend.adapters import (  # noqa: E402
    adapt,
)
from vit_graph_backend.adapters.packing import ROW_INDEX  # noqa: E402
from vit_graph_backend.adapters.staging import BLOCK  # noqa: E402
from vit_graph_backend.budgets import BudgetConfig  # noqa: E402
from vit_graph_backend.errors import (  # noqa: E402
    UnsupportedGraphError,
)
from vit_graph_backend.runtime.capture import BudgetGraph  # noqa: E402
from vit_graph_backend.runtime.replay_io import write_inputs  # noqa: E402
from vit_graph_backend.testing import image_grids  # noqa: E402

from qwen_towers import (EAGER_ATOL, FAMILIES, FAST, GRAPH_ATOL, GRID_SETS,  # noqa: E402
                         MAX_BUDGET, MERGE, MIN_BUDGET, PATCH, reference_dispatch,
                         _as_tuple, _assert_close, _hf, _hf_per_item, _inputs)
from qwen_towers import towers  # noqa: E402, F401 (a fixture)


# --------------------------------------------------------------------------- eager equivalence
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
    """``packed_attention="dense"``: budgets of one slot (one single-frame image per batch) run full
    attention as one dense SDPA call with the padding keys hidden (``key_masked_attention``);
    every image still gets HF's output, while a budget of two slots keeps segment attention."""
    hf, _ = towers[family]
    adapter = adapt(hf, min_budget=MIN_BUDGET, max_budget=MAX_BUDGET, packed_attention="dense")
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
