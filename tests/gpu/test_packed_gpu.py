"""Packed Qwen-VL towers served from CUDA graphs. Every test here needs CUDA (marked ``gpu``):
bf16 equivalence with the HF module (measured error printed), Inductor-fused block ops inside
the graphs equal to the unfused ones, one graph per budget, stats,
no NaN across many mixed calls sharing one pool, and ``torch.compile(served, backend="vitgraph")``
compiling nothing around the routing frame."""

from __future__ import annotations

import random

import pytest
import torch

from vit_graph_backend import serve
from packed_towers import DEV, DT, PATCH, PATCH_DIM, _call, _hf, _tower

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["qwen2", "qwen2_5", "qwen3"])
@torch.no_grad()
def test_served_tower_matches_hf_in_bf16(kind):
    tower = _tower(kind)
    patch = 16 if kind == "qwen3" else PATCH
    served = serve(tower, max_items_per_graph=4, max_budget=1024)
    rng = random.Random(0)
    worst = 0.0
    for k in range(12):
        pv, grid = _call(rng, 1 + k % 4, patch)
        got = served(pv, grid)
        got = got if isinstance(got, tuple) else (got,)
        ref = _hf(tower, pv, grid)
        for g, r in zip(got, ref, strict=True):
            assert g.shape == r.shape
            assert torch.isfinite(g).all()
            scale = r.float().abs().max().item()
            worst = max(worst, (g.float() - r.float()).abs().max().item() / max(scale, 1.0))
    mgr = served.manager
    print(f"{kind}: max relative error vs HF eager (bf16) {worst:.3g}; stats {mgr.stats.as_dict()}; "
          f"memory {mgr.memory_report()}")
    assert worst < 5e-2
    assert (served.encoder.aligned_mlp_bytes > 0) == (kind == "qwen2_5")
    fusion = served.encoder.fusion_state  # Inductor-fused block ops are on by default on CUDA
    assert fusion["unavailable"].get("cuda") is None and fusion["compile_failures"] == {}, fusion
    assert mgr.num_graphs == len(mgr.token_budgets) == mgr.get_num_graphs_to_capture()
    assert mgr.stats.graph_replays > 0 and mgr.stats.eager_items == 0
    # each MLP's first half runs through fused_linear's ops (fc1 + GELU, or the SiLU gate on
    # the padded width), timed per budget's rows
    from vit_graph_backend.adapters.aligned_mlp import mlp_linears
    from vit_graph_backend.kernels.fused_linear import CHOICES, gated_width

    epilogue = {"qwen2": "quick_gelu", "qwen2_5": "silu_mul", "qwen3": "gelu_tanh"}[kind]
    assert served.encoder.kernels.epilogue == epilogue
    width = mlp_linears(tower.blocks[0].mlp)[0][0].out_features
    if epilogue == "silu_mul":   # the packed gate/up copy: 122 -> 128 wide
        width = gated_width(width)
    assert any(k.endswith(f"x64 -> {width} {epilogue} +bias")
               for k in CHOICES.state["chosen"]), CHOICES.state


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@torch.no_grad()
def test_a_tower_on_the_second_gpu_is_served_there_whichever_gpu_is_current():
    """The Qwen2.5-VL tower on ``cuda:1`` while ``cuda:0`` is current: warm-ups, timed kernel
    choices (the gated MLP op), captures and replays all on ``cuda:1``, output equal to HF's."""
    dev = torch.device("cuda", 1)
    tower = _tower("qwen2_5").to(dev)
    served = serve(tower, max_items_per_graph=4, max_budget=1024)
    rng = random.Random(5)
    worst = 0.0
    with torch.cuda.device(0):
        for _ in range(6):
            pv, grid = (t.to(dev) for t in _call(rng, 1 + rng.randint(0, 3), PATCH))
            got = served(pv, grid)
            assert got.device == dev and torch.isfinite(got).all()
            ref = tower(pv, grid).pooler_output
            worst = max(worst, (got.float() - ref.float()).abs().max().item()
                        / max(ref.float().abs().max().item(), 1.0))
    print(f"qwen2_5 on cuda:1: max relative error vs HF eager {worst:.3g}")
    assert worst < 5e-2
    assert served.manager.stats.graph_replays > 0
    from vit_graph_backend.kernels.fused_linear import CHOICES
    assert any(k.startswith("cuda:1 ") and "silu_mul" in k for k in CHOICES.state["chosen"])


@pytest.mark.parametrize("kind", ["qwen2", "qwen2_5"])
@torch.no_grad()
def test_repeated_and_alternating_grids_match_hf_with_metadata_left_in_place(kind):
    """The metadata of a batch its budget ran last stays in the static buffers
    (``replay_io.write_inputs``: only the pixels are copied); Qwen2.5-VL's graphs gather their
    rows into window order themselves. Same grid with new pixels, then two grids in turn on one
    budget, then a shorter one (its pixel tail zeroed): every output is HF's."""
    from vit_graph_backend.adapters import packing as _qwen_packing
    from vit_graph_backend.adapters.staging import BLOCK

    tower = _tower(kind)
    served = serve(tower, max_items_per_graph=2, min_budget=128, max_budget=128)
    loads = []
    load = _qwen_packing._Staged.load

    def counted(self):
        out = load(self)
        loads.append({key: (value.device.type, value.dtype) for key, value in out.items()})
        return out

    _qwen_packing._Staged.load = counted
    try:
        worst = 0.0
        pattern = [[[1, 16, 16]]] * 3 + [[[1, 16, 12]], [[1, 8, 8], [1, 8, 16]]] * 2 + [[[1, 8, 8]]]
        for grids in pattern:
            rows = sum(t * h * w for t, h, w in grids)
            pv = torch.randn(rows, PATCH_DIM, device=DEV, dtype=DT)
            got, ref = served(pv, grids), _hf(tower, pv, torch.tensor(grids, device=DEV))[0]
            assert torch.isfinite(got).all() and got.shape == ref.shape
            worst = max(worst, (got.float() - ref.float()).abs().max().item()
                        / max(ref.float().abs().max().item(), 1.0))
    finally:
        _qwen_packing._Staged.load = load
    stats = served.manager.stats
    print(f"{kind}: repeated/alternating grids, max relative error vs HF {worst:.3g}, "
          f"{len(loads)} metadata loads for {len(pattern)} calls, "
          f"{served.encoder.staged_metadata_bytes} bytes of device records")
    assert worst < 5e-2 and stats.eager_items == 0 and stats.graph_replays == len(pattern)
    # the second and third call of one grid load nothing; every load is one device-to-device
    # copy of the batch's whole block, kept on the GPU since its first call
    assert loads == [{BLOCK: ("cuda", torch.uint8)}] * (len(pattern) - 2)
    assert 0 < served.encoder.staged_metadata_bytes <= _qwen_packing.STAGED_DEVICE_BYTES


@torch.no_grad()
def test_records_made_on_one_stream_serve_calls_on_another():
    """A batch's device record made on the default stream and loaded on a side stream is
    marked for the allocator (``record_stream``), and the outputs stay HF's on both streams."""
    tower = _tower("qwen2_5")
    served = serve(tower, max_items_per_graph=2, min_budget=128, max_budget=128)
    grids_in_turn = ([[1, 16, 12]], [[1, 8, 8], [1, 8, 16]])
    inputs = [(torch.randn(sum(t * h * w for t, h, w in g), PATCH_DIM, device=DEV, dtype=DT), g)
              for g in grids_in_turn]
    refs = [_hf(tower, pv, torch.tensor(g, device=DEV))[0] for pv, g in inputs]
    for pv, g in inputs:  # stage both on the default stream
        served(pv, g)
    marked, record_stream = [], torch.Tensor.record_stream

    def spy(self, stream):
        marked.append(stream)
        return record_stream(self, stream)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.Tensor.record_stream = spy
    try:
        with torch.cuda.stream(side):
            outs = [served(pv, g) for _ in range(2) for pv, g in inputs]
    finally:
        torch.Tensor.record_stream = record_stream
    torch.cuda.current_stream().wait_stream(side)
    for i, out in enumerate(outs):
        ref = refs[i % 2]
        scale = max(ref.float().abs().max().item(), 1.0)
        err = (out.float() - ref.float()).abs().max().item() / scale
        assert err < 5e-2, (i, err)
    print(f"records loaded on a side stream: {len(marked)} marked for 4 loads")
    assert len(marked) == 4 and all(s == side for s in marked)


@torch.no_grad()
def test_many_mixed_calls_share_one_pool_without_nan():
    tower = _tower("qwen2_5")
    served = serve(tower, max_items_per_graph=4, max_budget=128)  # 256-token images: eager
    rng = random.Random(3)
    for _ in range(40):
        pv, grid = _call(rng, rng.randint(1, 4), PATCH)
        out = served(pv, grid)
        assert torch.isfinite(out).all()
    mgr = served.manager
    pools = {e.graph.pool() for e in mgr.graphs.entries.values()}
    assert len(pools) == 1
    print("mixed calls stats", mgr.stats.as_dict())
    assert mgr.stats.eager_items > 0  # items over 128 tokens run eagerly, counted


@torch.no_grad()
def test_torch_compile_of_served_tower_compiles_nothing_around_routing():
    from vit_graph_backend.compile.backend import vitgraph

    tower = _tower("qwen2_5")
    served = serve(tower, max_items_per_graph=4, max_budget=512)
    compiled = torch.compile(served, backend="vitgraph")
    rng = random.Random(1)
    for _ in range(6):
        pv, grid = _call(rng, rng.randint(1, 3), PATCH)
        torch.testing.assert_close(compiled(pv, grid), served(pv, grid), atol=0, rtol=0)
    assert vitgraph.report()["compiles"] == 0


@torch.no_grad()
def test_weights_changed_after_capture_reach_the_replayed_graph():
    tower = _tower("qwen2_5")
    served = serve(tower, max_items_per_graph=4, max_budget=256)
    pv, grid = _call(random.Random(5), 2, PATCH)
    before = served(pv, grid)
    graphs = served.manager.num_graphs
    with torch.no_grad():
        for block in tower.blocks:
            block.mlp.down_proj.weight.mul_(-1.5)    # in place: padded copies refreshed
            block.attn.proj.bias.add_(0.25)         # read by the graph directly
            block.mlp.down_proj.bias.add_(0.5)      # read directly too (no padding needed)
    after = served(pv, grid)
    ref = _hf(tower, pv, grid)[0]
    err = ((after.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1)).item()
    print(f"after an in-place weight update: max relative error vs HF {err:.3g}")
    assert err < 5e-2 and not torch.allclose(before, after)
    assert served.manager.num_graphs == graphs  # no recapture needed


@torch.no_grad()
def test_a_tower_given_new_storage_is_captured_again_or_served_eagerly():
    """Graphs read the weights by address: after ``load_state_dict(..., assign=True)`` the old
    storage is freed, and replaying the old graphs would read it. The served tower captures
    again; after a dtype change it serves eagerly, saying why. Outputs are HF's each time."""
    tower = _tower("qwen2_5")
    served = serve(tower, max_items_per_graph=4, max_budget=256)
    pv, grid = _call(random.Random(6), 2, PATCH)
    served(pv, grid)
    tower.load_state_dict({k: v * 0.5 for k, v in tower.state_dict().items()}, assign=True)
    torch.cuda.empty_cache()  # the old weights' memory goes back to the allocator, reusable
    junk = torch.full((64 << 20,), float("nan"), device=DEV, dtype=DT)  # over the freed storage
    got, ref = served(pv, grid), _hf(tower, pv, grid)[0]
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1)).item()
    del junk
    mgr = served.manager
    print(f"after new storage: max relative error vs HF {err:.3g}; graphs {mgr.num_graphs}")
    assert err < 5e-2 and torch.isfinite(got).all() and mgr.num_graphs == len(mgr.token_budgets)
    tower.to(torch.float16)
    pv16 = pv.half()
    got, ref = served(pv16, grid), _hf(tower, pv16, grid)[0]
    assert "moved (cuda:0, torch.float16)" in (mgr.memory_report()["graphs_off_reason"] or "")
    torch.testing.assert_close(got, ref, atol=5e-2, rtol=0)
