"""Packed Qwen-VL towers served from CUDA graphs. Every test here needs CUDA (marked ``gpu``):
bf16 equivalence with the HF module (measured error printed), Inductor-fused block ops inside
the graphs equal to the unfused ones, one graph per budget, stats,
no NaN across many mixed calls sharing one pool, and ``torch.compile(served, backend="vitgraph")``
compiling nothing around the routing frame."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
tr = pytest.importorskip("transformers")

from toy_encoders import Wrapper  # noqa: E402

from vit_graph_backend import serve  # noqa: E402

DEV, DT = "cuda", torch.bfloat16
PATCH, MERGE = 14, 2
PATCH_DIM = 3 * 2 * PATCH * PATCH


def _tower(kind):
    torch.manual_seed(0)
    if kind == "qwen2":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel as M)
        cfg = Qwen2VLVisionConfig(depth=2, embed_dim=64, hidden_size=96, num_heads=2, mlp_ratio=2)
    elif kind == "qwen2_5":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as M)
        # intermediate 122 is not a multiple of 8 (like the 3B tower's 3420): the adapter's
        # padded MLP copies are in use on CUDA
        cfg = Qwen2_5_VLVisionConfig(depth=4, hidden_size=64, intermediate_size=122, num_heads=2,
                                     out_hidden_size=96, window_size=112,
                                     fullatt_block_indexes=[1, 3])
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as M
        cfg = Qwen3VLVisionConfig(depth=3, hidden_size=64, intermediate_size=120, num_heads=2,
                                  out_hidden_size=96, patch_size=16, num_position_embeddings=256,
                                  deepstack_visual_indexes=[0, 2])
    return M(cfg).to(DEV, DT).eval()


def _call(rng, n_images, patch):
    grids = [[1, 2 * rng.randint(4, 16), 2 * rng.randint(4, 16)] for _ in range(n_images)]
    rows = sum(t * h * w for t, h, w in grids)
    dim = 3 * 2 * patch * patch
    return (torch.randn(rows, dim, device=DEV, dtype=DT),
            torch.tensor(grids, device=DEV, dtype=torch.long))


def _hf(tower, pv, grid):
    out = tower(pv, grid)
    return (out.pooler_output, *(getattr(out, "deepstack_features", None) or ()))


def _worst_error_vs_hf(served, tower, rng, calls, images, patch):
    """Max over ``calls`` calls of ``images(rng)`` images each of every output's max abs error
    against HF's, relative to HF's max abs value (at least 1); every output finite."""
    worst = 0.0
    for _ in range(calls):
        pv, grid = _call(rng, images(rng), patch)
        got = served(pv, grid)
        got = got if isinstance(got, tuple) else (got,)
        for g, r in zip(got, _hf(tower, pv, grid), strict=True):
            assert torch.isfinite(g).all()
            worst = max(worst, (g.float() - r.float()).abs().max().item()
                        / max(r.float().abs().max().item(), 1.0))
    return worst


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
    from vit_graph_backend.adapters._aligned_mlp import mlp_linears
    from vit_graph_backend.fused_linear import CHOICES, gated_width

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
    from vit_graph_backend.fused_linear import CHOICES
    assert any(k.startswith("cuda:1 ") and "silu_mul" in k for k in CHOICES.state["chosen"])


@pytest.mark.parametrize("kind", ["qwen2", "qwen2_5"])
@torch.no_grad()
def test_repeated_and_alternating_grids_match_hf_with_metadata_left_in_place(kind):
    """The metadata of a batch its budget ran last stays in the static buffers
    (``replay_io.write_inputs``: only the pixels are copied); Qwen2.5-VL's graphs gather their
    rows into window order themselves. Same grid with new pixels, then two grids in turn on one
    budget, then a shorter one (its pixel tail zeroed): every output is HF's."""
    from vit_graph_backend.adapters import _qwen_packing
    from vit_graph_backend.adapters._staging import BLOCK

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
    from vit_graph_backend.backend import vitgraph

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
    assert "moved to cuda:0, torch.float16" in (mgr.memory_report()["graphs_off_reason"] or "")
    torch.testing.assert_close(got, ref, atol=5e-2, rtol=0)


@pytest.mark.parametrize("how", ["data", "table", "wrapped"])
@torch.no_grad()
def test_one_weight_given_new_storage_is_followed(how):
    """One weight other than the first gets new storage, and its old storage is freed and
    filled with NaN: by hand (``p.data = t``), written to its module's table as accelerate's
    ``set_module_tensor_to_device`` does, or, for a weight that is a wrapper tensor subclass (a
    quantized weight, say), in the tensor it holds. None fires a hook; replaying the old graphs
    would read the freed memory. The merger's last weight, tripled, so a stale read cannot pass
    for a small error. The served tower captures again and matches HF."""
    tower = _tower("qwen2_5")
    out = tower.merger.mlp[2]
    if how == "wrapped":
        out.weight = torch.nn.Parameter(Wrapper(out.weight.detach().clone()),
                                        requires_grad=False)
    served = serve(tower, max_items_per_graph=4, max_budget=256)
    pv, grid = _call(random.Random(7), 2, PATCH)
    served(pv, grid)
    if how == "data":
        out.weight.data = out.weight * 3.0
    elif how == "table":
        out._parameters["weight"] = torch.nn.Parameter(out.weight * 3.0)
    else:
        out.weight.inner = out.weight.inner * 3.0
    torch.cuda.empty_cache()
    junk = torch.full((64 << 20,), float("nan"), device=DEV, dtype=DT)  # over the freed storage
    got, ref = served(pv, grid), _hf(tower, pv, grid)[0]
    del junk
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1)).item()
    mgr = served.manager
    print(f"one weight given new storage ({how}): max relative error vs HF {err:.3g}; "
          f"graphs {mgr.num_graphs}")
    assert torch.isfinite(got).all() and err < 5e-2 and mgr.num_graphs == len(mgr.token_budgets)


@pytest.mark.parametrize("how", ["mlp", "block table", "activation table"])
@torch.no_grad()
def test_a_replaced_mlp_block_or_activation_is_followed(how):
    """A module of the tower replaced after capture: a block's MLP by assignment, a block by a
    write to its module table (no hook fires; torch.ao's ``convert`` writes this way), or a
    block's activation, SiLU to GELU, in its table. The padded MLP copies and the fused gated
    op were made from the old modules, and the graphs replay their code: the served tower
    chooses its MLP kernels again, captures again and matches HF."""
    tower, other = _tower("qwen2_5"), _tower("qwen2_5")
    other.blocks[1].mlp.down_proj.weight.mul_(3.0)   # the new modules compute something else
    served = serve(tower, max_items_per_graph=4, max_budget=256)
    pv, grid = _call(random.Random(8), 2, PATCH)
    before = served(pv, grid).clone()
    replays = served.manager.stats.graph_replays
    if how == "mlp":
        tower.blocks[1].mlp = other.blocks[1].mlp
    elif how == "block table":
        tower.blocks._modules["1"] = other.blocks[1]
    else:
        tower.blocks[2].mlp._modules["act_fn"] = torch.nn.GELU()
    got, ref = served(pv, grid), _hf(tower, pv, grid)[0]
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1)).item()
    mgr = served.manager
    print(f"a module replaced ({how}): max relative error vs HF {err:.3g}; fused MLP op "
          f"{served.encoder.kernels.epilogue}; graphs {mgr.num_graphs}")
    assert torch.isfinite(got).all() and err < 5e-2 and not torch.allclose(got, before)
    assert mgr.num_graphs == len(mgr.token_budgets) and mgr.stats.graph_replays > replays
    assert served.encoder.kernels.epilogue == (None if how == "activation table" else "silu_mul")


@pytest.mark.parametrize("how", ["hook", "instance forward", "class forward", "functional",
                                 "class swap"])
@torch.no_grad()
def test_a_forward_hook_inside_the_tower_runs_and_the_graphs_come_back_without_it(how):
    """Graphs replay without hooks: while a block has a forward hook, a forward replaced on its
    instance (as accelerate's hooks do) or on its class, another class set on it, or while the
    functional attention HF calls is patched process-wide (SageAttention's way;
    ``code_watch.py``), the served tower's calls run its own forward (the change is in the
    output), and replay again once it is gone. The checks run after the graph's launch
    (``call_checks.py``): its output is dropped."""
    tower = _tower("qwen2_5")
    served = serve(tower, max_items_per_graph=4, max_budget=256)
    pv, grid = _call(random.Random(9), 2, PATCH)
    served(pv, grid)
    stats = served.manager.stats
    replays = stats.graph_replays
    shift = torch.linspace(-1.0, 1.0, tower.config.hidden_size, device=DEV, dtype=DT)
    block = tower.blocks[1]
    cls, own = type(block), type(block).forward
    sdpa = F.scaled_dot_product_attention
    if how == "class swap":  # this block only
        block.__class__ = type("Shifted", (cls,), {
            "forward": lambda self, *args, **kwargs: own(self, *args, **kwargs) + shift})
    elif how == "functional":  # every attention call in the process
        F.scaled_dot_product_attention = lambda *args, **kwargs: sdpa(*args, **kwargs) + 1.0
    elif how == "hook":
        handle = block.register_forward_hook(lambda m, a, o: o + shift)
    elif how == "class forward":  # every block of the class
        cls.forward = lambda self, *args, **kwargs: own(self, *args, **kwargs) + shift
    else:
        bound = block.forward
        block.forward = lambda *args, **kwargs: bound(*args, **kwargs) + shift
    try:
        got, ref = served(pv, grid), _hf(tower, pv, grid)[0]
    finally:
        if how == "class swap":
            block.__class__ = cls
        elif how == "functional":
            F.scaled_dot_product_attention = sdpa
        elif how == "hook":
            handle.remove()
        elif how == "class forward":
            cls.forward = own
        else:
            del block.forward
    assert stats.graph_replays == replays and stats.eager_batches == 1
    after, plain = served(pv, grid), _hf(tower, pv, grid)[0]
    errs = [((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1)).item()
            for a, b in ((got, ref), (after, plain))]
    print(f"a block's {how}: max relative error vs HF {errs[0]:.3g} (tower's own "
          f"forward), after its removal {errs[1]:.3g} (graphs)")
    assert max(errs) < 5e-2 and stats.graph_replays > replays
    assert not torch.allclose(ref, plain, atol=1e-2)


@pytest.mark.parametrize("kind", ["qwen2", "qwen2_5", "qwen3"])
@torch.no_grad()
def test_fused_graphs_equal_unfused_graphs(kind, monkeypatch):
    """The Inductor-fused rotary / residual-add + norm / SiLU gate inside the captured graphs
    (default on CUDA) against the same graphs with the ops unfused (``fuse=False``)."""
    from vit_graph_backend import adapt
    from vit_graph_backend.adapters import _fused

    monkeypatch.setattr(_fused, "_COMPILED", None)  # a fresh set: what compiles is this test's
    tower = _tower(kind)
    patch = 16 if kind == "qwen3" else PATCH
    fused = serve(tower, max_items_per_graph=4, max_budget=512)
    plain = serve(adapt(tower, fuse=False), max_items_per_graph=4, max_budget=512)
    rng = random.Random(7)
    worst = 0.0
    for k in range(8):
        pv, grid = _call(rng, 1 + k % 3, patch)
        got, ref = fused(pv, grid), plain(pv, grid)
        for g, r in zip(got if isinstance(got, tuple) else (got,),
                        ref if isinstance(ref, tuple) else (ref,), strict=True):
            assert torch.isfinite(g).all()
            scale = max(r.float().abs().max().item(), 1.0)
            worst = max(worst, (g.float() - r.float()).abs().max().item() / scale)
    compiled = [n for n in ("rotate_qk", "add_rms_norm", "add_layer_norm", "silu_mul")
                if getattr(_fused.ops(True), n).compiled is not None]
    print(f"{kind}: fused vs unfused graphs, max relative error (bf16) {worst:.3g}; "
          f"compiled: {compiled}")
    assert "rotate_qk" in compiled
    assert worst < 3e-2
    assert fused.manager.stats.eager_items == 0 and plain.manager.stats.eager_items == 0


@torch.no_grad()
def test_inductor_inner_compiler_compiles_once_for_every_budget(monkeypatch):
    """``inner_compiler="inductor"``: the tower's compute is compiled by Inductor once (row
    dimensions symbolic) and every budget's graph captures it; outputs match HF in bf16."""
    from vit_graph_backend import packed

    real = packed.inner_backend
    compiles = []

    def counting(options):
        backend = real(options)

        def wrapped(gm, example_inputs, **kwargs):
            compiles.append(len(example_inputs))
            return backend(gm, example_inputs, **kwargs)
        return wrapped

    monkeypatch.setattr(packed, "inner_backend", counting)
    tower = _tower("qwen2_5")
    served = serve(tower, max_items_per_graph=4, max_budget=512, inner_compiler="inductor")
    rng = random.Random(11)
    worst = 0.0
    for k in range(6):
        pv, grid = _call(rng, 1 + k % 3, PATCH)
        got, ref = served(pv, grid), _hf(tower, pv, grid)[0]
        assert torch.isfinite(got).all()
        worst = max(worst, (got.float() - ref.float()).abs().max().item()
                    / max(ref.float().abs().max().item(), 1.0))
    mgr = served.manager
    print(f"inductor inner: {len(compiles)} compile(s) for {mgr.num_graphs} graphs; max relative "
          f"error vs HF (bf16) {worst:.3g}; capture {mgr.memory_report()['capture_seconds']} s")
    assert mgr.num_graphs == len(mgr.token_budgets) and not mgr.memory_report()["disabled_budgets"]
    assert len(compiles) == 1
    assert worst < 5e-2


def _busy_gpu(ms: float = 60.0) -> torch.cuda.Event:
    """Queue about ``ms`` of matmuls on the current stream; the event marks their end."""
    a = torch.randn(8192, 8192, device=DEV, dtype=DT)
    for _ in range(max(1, round(ms / 1.6))):  # ~1.6 ms per 8192^3 bf16 matmul on an H100
        a = a @ a
        a = a / a.abs().amax().clamp(min=1)  # keep it finite
    done = torch.cuda.Event()
    done.record()
    return done


@torch.no_grad()
def test_a_replayed_call_does_not_wait_for_a_busy_gpu():
    """With ``grid_thw`` given as a list, a replayed call reads nothing back from the GPU: its
    metadata goes through pinned memory (``adapters/_staging.py``), so the host returns while
    earlier GPU work still runs, and the output is still right once that work is done."""
    tower = _tower("qwen2_5")  # window attention: the pixel gather's index is staged too
    served = serve(tower, max_items_per_graph=4, max_budget=1024)
    grids = [[1, 16, 24], [1, 8, 8]]
    pv = torch.randn(sum(t * h * w for t, h, w in grids), PATCH_DIM, device=DEV, dtype=DT)
    first = served(pv, grids)  # captures, then replays
    torch.cuda.synchronize()
    busy = _busy_gpu()
    got = served(pv, grids)
    returned_while_busy = not busy.query()
    torch.cuda.synchronize()
    ref = _hf(tower, pv, torch.tensor(grids, device=DEV))[0]
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1)).item()
    print(f"returned while the GPU was busy: {returned_while_busy}; max relative error vs HF "
          f"{err:.3g}; stats {served.manager.stats.as_dict()}")
    assert returned_while_busy
    assert torch.equal(got, first) and err < 5e-2
    assert served.manager.stats.eager_items == 0


@torch.no_grad()
def test_back_to_back_calls_queued_behind_a_busy_gpu_match_hf():
    """Twenty calls of different sizes queued without a sync behind busy work: every call's
    staged metadata must still be the one its graph reads (a pinned block reused too early, or
    a static buffer overwritten before the previous replay read it, would give wrong rows)."""
    tower = _tower("qwen2_5")
    served = serve(tower, max_items_per_graph=4, max_budget=1024)
    rng = random.Random(13)
    calls = []
    for k in range(20):
        grids = [[1, 2 * rng.randint(4, 16), 2 * rng.randint(4, 16)] for _ in range(1 + k % 3)]
        rows = sum(t * h * w for t, h, w in grids)
        calls.append((torch.randn(rows, PATCH_DIM, device=DEV, dtype=DT), grids))
    for pv, grids in calls:  # first pass: captures every budget this stream needs
        served(pv, grids)
    torch.cuda.synchronize()
    busy = _busy_gpu()
    outs = [served(pv, grids) for pv, grids in calls]
    queued = not busy.query()
    torch.cuda.synchronize()
    worst = 0.0
    for (pv, grids), got in zip(calls, outs, strict=True):
        ref = _hf(tower, pv, torch.tensor(grids, device=DEV))[0]
        worst = max(worst, (got.float() - ref.float()).abs().max().item()
                    / max(ref.float().abs().max().item(), 1.0))
    stats = served.manager.stats
    print(f"20 calls queued behind busy work: {queued}; max relative error vs HF {worst:.3g}; "
          f"replays {stats.graph_replays}")
    assert queued and worst < 5e-2 and stats.eager_items == 0


@pytest.mark.parametrize("kind", ["qwen2_5", "qwen3"])
@pytest.mark.parametrize("attention", ["auto", "dense"])
@torch.no_grad()
def test_full_attention_kernel_per_one_image_budget_matches_hf(kind, attention):
    """Budgets of one image (``max_items_per_graph=1``): ``"auto"`` times flash varlen against
    dense SDPA on each budget's shapes before its capture and keeps the faster; ``"dense"``
    always takes dense SDPA with the padding keys hidden. Either way every image gets HF's
    output (Qwen2.5-VL's window layers: the kernel timed faster per budget,
    ``test_short_attention_gpu.py``)."""
    tower = _tower(kind)
    patch = 16 if kind == "qwen3" else PATCH
    served = serve(tower, max_items_per_graph=1, max_budget=512, attention=attention)
    worst = _worst_error_vs_hf(served, tower, random.Random(17), 8, lambda rng: 1, patch)
    state = served.encoder.attention_state
    print(f"{kind}, attention={attention}: max relative error vs HF (bf16) {worst:.3g}; "
          f"kernels {state['by_rows']}; timings ms {state['timings_ms']}")
    assert worst < 5e-2
    mgr = served.manager
    assert mgr.stats.eager_items == 0 and len(state["by_rows"]) == mgr.num_graphs
    if attention == "dense":
        assert set(state["by_rows"].values()) == {"dense"}
    else:  # every budget timed; dense kept only where timed at least 10 % faster
        assert state["timings_ms"].keys() == state["by_rows"].keys()
        for rows, ms in state["timings_ms"].items():
            dense = ms["dense"] < 0.9 * ms["varlen"]
            assert state["by_rows"][rows] == ("dense" if dense else "varlen"), (rows, ms)
