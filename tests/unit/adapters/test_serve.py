"""``packed.py``: ``serve()`` and ``PackedGraphEncoder`` through their public seams.

A tiny random Qwen2-VL tower on CPU: ``run()`` gives one output per item equal to the packed
``forward``'s rows; options and option keywords together are refused; a served tower is counted by
``vit_graph_backend.report()`` while alive; ``torch.compile(served, backend="vitgraph")`` compiles
nothing around the routing (``forward`` is excluded from Dynamo) and returns the same output.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig  # noqa: E402
from transformers.models.qwen2_vl.modeling_qwen2_vl import (  # noqa: E402
    Qwen2VisionTransformerPretrainedModel,
)

import vit_graph_backend as vg  # noqa: E402
from vit_graph_backend.compile.backend import vitgraph  # noqa: E402
from vit_graph_backend.adapters import serve as packed_mod  # noqa: E402
from toy_encoders import Wrapper  # noqa: E402

GRID = [[1, 4, 4], [1, 2, 4], [1, 2, 2]]


def _served(**options):
    torch.manual_seed(0)
    tower = Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(
        depth=1, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2, patch_size=2)).eval()
    return vg.serve(tower, min_budget=4, max_budget=16, **options)


def _pixels():
    return torch.randn(sum(t * h * w for t, h, w in GRID), 24,
                       generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_run_gives_one_output_per_item_in_order():
    served, pixels = _served(), _pixels()
    packed = served(pixels, GRID)
    items = served.run({"pixel_values": pixels, "grid_thw": torch.tensor(GRID)})
    assert [o.shape[0] for o in items] == [t * h * w // 4 for t, h, w in GRID]
    torch.testing.assert_close(torch.cat(items), packed, rtol=0, atol=0)


def test_options_and_option_keywords_together_are_refused():
    with pytest.raises(vg.InvalidOptionError, match="give options or option keywords, not both"):
        vg.PackedGraphEncoder(_served().encoder, vg.VitGraphOptions(), max_budget=16)


@torch.no_grad()
def test_a_live_served_tower_is_in_the_top_level_report():
    gc.collect()  # an earlier test's tower left in a cycle would otherwise go during this test
    before = vg.report()["served_towers"]
    served = _served()
    served(_pixels(), GRID)
    assert vg.report()["served_towers"] == before + 1
    del served
    gc.collect()
    assert vg.report()["served_towers"] == before


@torch.no_grad()
def test_compiling_a_served_tower_compiles_nothing_around_the_routing():
    served, pixels = _served(), _pixels()
    expected = served(pixels, GRID)
    compiled = torch.compile(served, backend="vitgraph")
    torch.testing.assert_close(compiled(pixels, GRID), expected, rtol=0, atol=0)
    assert vitgraph.report()["compiles"] == 0


def test_items_back_to_back_in_one_storage_join_as_a_view_else_cat():
    """``forward`` returns one batch's items as a view of the rows cloned from the graph's
    output, not a second copy; anything else (items out of order, other storages, autograd
    history) goes through ``torch.cat``. Either way the values are ``torch.cat``'s."""
    from vit_graph_backend.adapters.serve import _joined

    base = torch.arange(40.0).reshape(10, 4)
    parts = [base[0:3], base[3:4], base[4:10]]
    joined = _joined(parts)
    assert torch.equal(joined, torch.cat(parts))
    assert joined.data_ptr() == base.data_ptr()  # a view: no copy
    for other in ([base[3:4], base[0:3]],                      # not in storage order
                  [base[0:3], base[4:10]],                     # a gap
                  [base[0:3], base.clone()[3:4]],              # another storage
                  [base[0:2, :2], base[2:4, :2]]):             # not contiguous
        out = _joined(other)
        assert torch.equal(out, torch.cat(other))
        assert out.data_ptr() != base.data_ptr()
    grad = torch.arange(8.0, requires_grad=True).reshape(4, 2) * 1
    out = _joined([grad[:2], grad[2:]])
    assert out.data_ptr() != grad.data_ptr() and out.grad_fn is not None


@torch.no_grad()
def test_a_one_batch_call_returns_its_rows_without_a_second_copy(padded_cpu):
    # items of one size: the planner keeps the caller's order inside the batch, so the rows
    # cloned from the graph's output are the answer as they lie
    grid = [[1, 2, 4]] * 3
    served = _served()
    pixels = torch.randn(24, 24, generator=torch.Generator().manual_seed(2))
    packed = served(pixels, grid)
    report = served.report()["stats"]
    items = served.run({"pixel_values": pixels, "grid_thw": torch.tensor(grid)})
    assert report["calls"] == 1 and sum(report["batches_per_budget"].values()) == 1, report
    assert packed._base is not None  # a view of the one clone of the graph's rows, not a cat
    torch.testing.assert_close(packed, torch.cat(items), rtol=0, atol=0)


@torch.no_grad()
def test_a_repeated_list_grid_reuses_its_tensor_but_is_checked_like_a_new_one(monkeypatch):
    served, pixels = _served(), _pixels()
    first, rows = served._grid_of(GRID)
    assert rows == [tuple(row) for row in GRID]
    again, _ = served._grid_of([list(row) for row in GRID])
    assert again is first and torch.equal(first, torch.tensor(GRID))  # equal rows: same tensor
    other = [[1, 4, 4], [1, 2, 4], [1, 2, 4]]
    assert served._grid_of(other)[0] is not first and served._grid_of(other)[0].tolist() == other
    assert served._grid_of(torch.tensor(GRID).numpy())[1] is None  # NumPy ints: read as before
    # equal as Python values (1.0 == 1), but a float stays refused as without the reuse
    served._grid_of(GRID)
    with pytest.raises(vg.InvalidInputError, match="must be integers"):
        served(pixels, [[1.0, 4, 4], [1, 2, 4], [1, 2, 2]])
    expected = served(pixels, torch.tensor(GRID))
    torch.testing.assert_close(served(pixels, GRID), expected, rtol=0, atol=0)
    # grids in turn are each kept (a stream of sizes), up to a bound: the oldest go first
    assert served._grid_of(GRID)[0] is first and served._grid_of(other)[0] is not first
    monkeypatch.setattr(packed_mod, "KEPT_GRIDS", 3)
    rows_of = [[[1, 2, 2 * k]] for k in range(1, 6)]
    grids = [served._grid_of(rows)[0] for rows in rows_of]
    assert len(served._grids) == 3
    assert served._grid_of(rows_of[-1])[0] is grids[-1]
    assert served._grid_of(rows_of[0])[0] is not grids[0]  # dropped, made again


@torch.no_grad()
def test_a_tower_given_new_storage_is_captured_again_or_served_eagerly(caplog, padded_cpu):
    """Graphs read weights by address: new storage for the tower (``load_state_dict(...,
    assign=True)``, ``.to()``) clears its graphs, or turns them off when the dtype or device
    changed; outputs follow the tower's weights either way."""
    served, pixels = _served(), _pixels()
    tower = served.encoder.tower
    served(pixels, GRID)
    entries = served.manager.graphs.entries
    assert entries  # the CPU path's static buffers stand in for graphs
    state = {k: v * 1.5 for k, v in tower.state_dict().items()}
    tower.load_state_dict(state, assign=True)  # every parameter a new tensor
    with caplog.at_level("WARNING", logger="vit_graph_backend"):
        out = served(pixels, GRID)
    assert "captured again" in caplog.text
    expected = tower(pixels, torch.tensor(GRID)).pooler_output
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    served(pixels, GRID)  # followed once: no second clear
    assert caplog.text.count("captured again") == 1
    tower.to(torch.float64)
    out = served(pixels.double(), GRID)
    reason = served.manager.memory_report()["graphs_off_reason"]
    assert reason and "moved (cpu, torch.float64)" in reason
    torch.testing.assert_close(out, tower(pixels.double(), torch.tensor(GRID)).pooler_output)


@torch.no_grad()
@pytest.mark.parametrize("how", ["data", "table", "wrapped"])
def test_one_weight_given_new_storage_is_followed(how, caplog, padded_cpu):
    """One weight other than the first given new storage: by hand (``p.data = t``), written to
    its module's table as accelerate's ``set_module_tensor_to_device`` does, or, for a weight
    that is a wrapper tensor subclass, in the tensor it holds. No registration hook fires for
    any; the graphs would read the old address, so they are captured again."""
    served, pixels = _served(), _pixels()
    tower = served.encoder.tower
    proj = tower.blocks[0].attn.proj
    if how == "wrapped":  # put in before the first call, whose watch then follows it
        proj.weight = torch.nn.Parameter(Wrapper(proj.weight.detach().clone()),
                                         requires_grad=False)
    served(pixels, GRID)
    caplog.clear()
    if how == "data":
        proj.weight.data = proj.weight * 2
    elif how == "table":
        proj._parameters["weight"] = torch.nn.Parameter(proj.weight * 2)
    else:
        proj.weight.inner = proj.weight.inner * 2
    with caplog.at_level("WARNING", logger="vit_graph_backend"):
        out = served(pixels, GRID)
    assert "captured again" in caplog.text
    expected = tower(pixels, torch.tensor(GRID)).pooler_output
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    served(pixels, GRID)
    assert caplog.text.count("captured again") == 1


def _as_hf_then_graphs_again(served, pixels, got, want, plain):
    """``got`` (served while something the graphs skip was there) is HF's ``want``, which that
    changed; once it is gone, the served output is HF's ``plain`` again, on the graph path (no
    eager batch more)."""
    assert not torch.allclose(want, plain, atol=1e-3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    eager = served.manager.stats.eager_batches
    torch.testing.assert_close(served(pixels, GRID), plain, atol=1e-5, rtol=1e-5)
    assert served.manager.stats.eager_batches == eager


def _shifting_hook(seen, target):
    def hook(called, args, output):  # a global hook sees every module's call, served's too
        seen.append(type(called).__name__)
        # a shift that differs across features: a LayerNorm after it does not undo it
        shift = torch.linspace(-1.0, 1.0, output.shape[-1]) if called is target else None
        return output + shift if shift is not None else output
    return hook


@torch.no_grad()
@pytest.mark.parametrize("where", ["block", "attention", "linear", "global"])
@pytest.mark.parametrize("path", ["graphs", "cpu"])
def test_forward_hooks_inside_the_tower_run_as_in_its_own_forward(where, path, caplog,
                                                                  monkeypatch):
    """The adapter runs a block's parts itself and a graph replays without any hook: a forward
    hook inside the tower at the first capture turns the graphs off, with the reason, and calls
    run the tower's own forward, the hook's effect and calls HF's (``weights.py``). Without
    graphs (CPU) every call runs it so while the hook is there."""
    if path == "graphs":
        from vit_graph_backend.runtime.manager import EncoderCudaGraphManager

        monkeypatch.setattr(EncoderCudaGraphManager, "pad_without_graphs", True)
    served, pixels = _served(), _pixels()
    tower = served.encoder.tower
    seen = []
    module = {"block": tower.blocks[0], "attention": tower.blocks[0].attn,
              "linear": tower.blocks[0].mlp.fc2, "global": None}[where]
    target = tower.blocks[0].mlp.fc2 if module is None else module
    hook = _shifting_hook(seen, target)
    handle = (torch.nn.modules.module.register_module_forward_hook(hook) if module is None
              else module.register_forward_hook(hook))
    try:
        want = tower(pixels, torch.tensor(GRID)).pooler_output
        calls_in_forward = len(seen)
        with caplog.at_level("WARNING", logger="vit_graph_backend"):
            got = served(pixels, GRID)
        assert len(seen) == 2 * calls_in_forward  # once more, as HF's forward runs them
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if path == "graphs":
            reason = served.manager.memory_report()["graphs_off_reason"]
            assert "Python that graphs skip" in reason
            assert ("a global forward hook" if module is None else "has forward hooks") in reason
    finally:
        handle.remove()
    served.refresh()   # the hook removed: graphs (or the adapter's code) serve again
    plain = tower(pixels, torch.tensor(GRID)).pooler_output
    torch.testing.assert_close(served(pixels, GRID), plain, atol=1e-5, rtol=1e-5)
    assert served.manager.memory_report()["graphs_off_reason"] is None


@torch.no_grad()
def test_a_hook_added_after_the_capture_runs_once_refresh_is_called(padded_cpu):
    """The contract: a hook added after the graphs were captured is announced with
    ``refresh()``; from then on calls run it."""
    served, pixels = _served(), _pixels()
    tower = served.encoder.tower
    served(pixels, GRID)
    seen = []
    handle = tower.blocks[0].register_forward_hook(_shifting_hook(seen, tower.blocks[0]))
    try:
        served.refresh()
        want = tower(pixels, torch.tensor(GRID)).pooler_output
        seen.clear()
        torch.testing.assert_close(served(pixels, GRID), want, atol=1e-5, rtol=1e-5)
        assert seen == ["Qwen2VLVisionBlock"]
    finally:
        handle.remove()


class _PatchedAttention:
    """A forward defined in this test module, patched into the tower's attention class."""

    @staticmethod
    def forward(self, hidden_states, *args, **kwargs):
        return _ORIGINAL_FORWARD[0](self, hidden_states, *args, **kwargs) * 0.5


_ORIGINAL_FORWARD: list = []


@torch.no_grad()
@pytest.mark.parametrize("when", ["before serving", "after, with refresh"])
def test_code_patched_into_a_tower_class_runs_as_in_the_towers_own_forward(when, padded_cpu,
                                                                           monkeypatch):
    """A class of the tower whose ``forward`` was patched in from another module runs the
    patch: the graphs (which run the adapter's code) are off and calls run the tower's own
    forward; patched after the capture, once ``refresh()`` announces it."""
    served, pixels = _served(), _pixels()
    tower = served.encoder.tower
    cls = type(tower.blocks[0].attn)
    _ORIGINAL_FORWARD[:] = [cls.forward]
    if when == "after, with refresh":
        served(pixels, GRID)
    monkeypatch.setattr(cls, "forward", _PatchedAttention.forward)
    if when == "after, with refresh":
        served.refresh()
    want = tower(pixels, torch.tensor(GRID)).pooler_output
    torch.testing.assert_close(served(pixels, GRID), want, atol=1e-5, rtol=1e-5)
    assert "patched in from" in served.manager.memory_report()["graphs_off_reason"]


@torch.no_grad()
def test_blocks_marked_as_nested_compile_regions_keep_the_graphs(padded_cpu):
    """``mark_layer_regions`` on a whole model (a VLM's text layers and its tower's blocks)
    before serving: a region runs its function unchanged, so it is not patched code."""
    torch.manual_seed(0)
    tower = Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(
        depth=2, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2, patch_size=2)).eval()
    assert vg.mark_layer_regions(tower) == 2
    served, pixels = vg.serve(tower, min_budget=4, max_budget=16), _pixels()
    want = tower(pixels, torch.tensor(GRID)).pooler_output
    torch.testing.assert_close(served(pixels, GRID), want, atol=1e-5, rtol=1e-5)
    assert served.manager.memory_report()["graphs_off_reason"] is None
    assert served.manager.stats.eager_batches == 0


@torch.no_grad()
def test_a_forward_set_on_an_attention_instance_runs_as_in_the_towers_own_forward(padded_cpu):
    """Hand-patched attention (to record its maps, say) and accelerate's hooks replace
    ``forward`` on the instance; the adapter calls the attention's parts, not its forward."""
    served, pixels = _served(), _pixels()
    tower = served.encoder.tower
    attn = tower.blocks[0].attn
    own = attn.forward
    attn.forward = lambda *args, **kwargs: own(*args, **kwargs) * 0.5
    want = tower(pixels, torch.tensor(GRID)).pooler_output
    torch.testing.assert_close(served(pixels, GRID), want, atol=1e-5, rtol=1e-5)
    assert "forward set on the instance" in served.manager.memory_report()["graphs_off_reason"]


@torch.no_grad()
def test_a_hook_on_the_tower_itself_runs_around_the_call_and_keeps_the_graphs():
    served, pixels = _served(), _pixels()
    handle = served.encoder.tower.register_forward_hook(lambda m, a, o: None)
    try:
        served(pixels, GRID)
        assert served.manager.stats.eager_batches == 0
    finally:
        handle.remove()


def test_a_batch_invariant_tower_runs_one_attention_kernel_and_no_timed_mlp():
    from qwen_towers import _qwen2_5

    served = vg.serve(_qwen2_5().eval(), batch_invariant=True)
    assert served.encoder.attention_state["attention"] == "varlen"
    assert served.encoder.kernels.epilogue_fusion == "off"
    with pytest.raises(vg.InvalidOptionError, match="packed_attention='cudnn' is invalid with "
                                                    "batch_invariant=True"):
        vg.serve(_qwen2_5().eval(), batch_invariant=True, packed_attention="cudnn")


@torch.no_grad()
def test_on_cpu_a_served_tower_pads_nothing_and_holds_no_static_buffers():
    """No graph can exist on CPU, so nothing is padded for one: every planned batch runs at its
    own size (the plan -> run -> slice path stays), and the report says so."""
    served, pixels = _served(), _pixels()
    torch.testing.assert_close(served(pixels, GRID), served.encoder.tower(
        pixels, torch.tensor(GRID)).pooler_output, atol=1e-5, rtol=1e-5)
    report = served.report()
    assert report["stats"]["padded_tokens"] == 0 and report["stats"]["padding_ratio"] == 0.0
    assert report["static_input_bytes"] == 0 and report["graphs_captured"] == 0
    assert report["stats"]["no_graph_batches"] >= 1 and report["stats"]["eager_batches"] == 0
