"""Packed Qwen-VL towers served from CUDA graphs, what the graphs must follow (marked ``gpu``):
weights given new storage followed, replaced blocks or activations and forward hooks announced
with ``refresh()`` (captured again or served eagerly), Inductor-fused block ops equal to the unfused ones and compiled once for
every budget, calls queued behind a busy GPU, and each full-attention kernel per one-image budget
against HF. The towers and helpers: ``tests/packed_towers.py``."""

from __future__ import annotations

import random

import pytest
import torch

from toy_encoders import Wrapper

from vit_graph_backend import serve
from packed_towers import DEV, DT, PATCH, PATCH_DIM, _call, _hf, _tower, _worst_error_vs_hf

pytestmark = pytest.mark.gpu


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


@pytest.mark.parametrize("how", ["data", "table", "inference tensor"])
@torch.no_grad()
def test_an_mlp_weight_given_new_storage_is_followed_by_its_padded_copy(how):
    """The graphs read the MLP weights only through padded copies. One given new storage, its
    old storage freed and filled with NaN: the per-call address check sees it before any
    launch and the graphs are captured again, the copies made anew; made an inference tensor
    (whose in-place writes leave no trace), captured again with the tower's own MLPs. Two calls
    each; all match HF."""
    tower = _tower("qwen2_5")
    served = serve(tower, max_items_per_graph=4, max_budget=256)
    pv, grid = _call(random.Random(7), 2, PATCH)
    served(pv, grid)
    mgr = served.manager
    graphs = {budget: entry.graph for budget, entry in mgr.graphs.entries.items()}
    gate = tower.blocks[1].mlp.gate_proj
    if how == "data":
        gate.weight.data = gate.weight * 3.0
    elif how == "table":
        gate._parameters["weight"] = torch.nn.Parameter(gate.weight * 3.0)
    else:
        with torch.inference_mode():
            gate._parameters["weight"] = gate.weight * 3.0
    torch.cuda.empty_cache()
    junk = torch.full((64 << 20,), float("nan"), device=DEV, dtype=DT)  # over the freed storage
    ref = _hf(tower, pv, grid)[0].float()
    outs = [served(pv, grid).float() for _ in range(2)]
    del junk
    errs = [((o - ref).abs().max() / ref.abs().max().clamp(min=1)).item() for o in outs]
    kept = all(mgr.graphs.entries.get(b) is not None and mgr.graphs.entries[b].graph is g
               for b, g in graphs.items())
    print(f"an MLP weight given new storage ({how}): max relative errors vs HF "
          f"{', '.join(f'{e:.3g}' for e in errs)}; graphs kept {kept}; copies in use "
          f"{served.encoder.kernels.use_aligned}")
    assert all(torch.isfinite(o).all() for o in outs) and max(errs) < 5e-2
    assert not kept and mgr.num_graphs == len(mgr.token_budgets)
    assert served.encoder.kernels.use_aligned == (how != "inference tensor")


@pytest.mark.parametrize("how", ["mlp", "block table", "activation table"])
@torch.no_grad()
def test_a_replaced_mlp_block_or_activation_is_followed(how):
    """A module of the tower replaced after capture: a block's MLP by assignment, a block by a
    write to its module table (torch.ao's ``convert`` writes this way), or a block's
    activation, SiLU to GELU, in its table, then announced with ``refresh()`` (the contract:
    ``runtime/weights.py``): the served tower chooses its MLP kernels again, captures again and
    matches HF."""
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
    served.refresh()
    got, ref = served(pv, grid), _hf(tower, pv, grid)[0]
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1)).item()
    mgr = served.manager
    print(f"a module replaced ({how}): max relative error vs HF {err:.3g}; fused MLP op "
          f"{served.encoder.kernels.epilogue}; graphs {mgr.num_graphs}")
    assert torch.isfinite(got).all() and err < 5e-2 and not torch.allclose(got, before)
    assert mgr.num_graphs == len(mgr.token_budgets) and mgr.stats.graph_replays > replays
    assert served.encoder.kernels.epilogue == (None if how == "activation table" else "silu_mul")


@pytest.mark.parametrize("how", ["hook", "instance forward", "class forward"])
@torch.no_grad()
def test_a_forward_hook_inside_the_tower_runs_and_the_graphs_come_back_without_it(how):
    """Graphs replay without hooks: a block given a forward hook, a forward replaced on its
    instance (as accelerate's hooks do) or on its class, announced with ``refresh()``, makes
    the served tower's calls run its own forward (the change is in the output); removed and
    announced again, the graphs replay again."""
    tower = _tower("qwen2_5")
    served = serve(tower, max_items_per_graph=4, max_budget=256)
    pv, grid = _call(random.Random(9), 2, PATCH)
    served(pv, grid)
    stats = served.manager.stats
    shift = torch.linspace(-1.0, 1.0, tower.config.hidden_size, device=DEV, dtype=DT)
    block = tower.blocks[1]
    cls, own = type(block), type(block).forward
    if how == "hook":
        handle = block.register_forward_hook(lambda m, a, o: o + shift)
    elif how == "class forward":  # every block of the class
        cls.forward = lambda self, *args, **kwargs: own(self, *args, **kwargs) + shift
    else:
        bound = block.forward
        block.forward = lambda *args, **kwargs: bound(*args, **kwargs) + shift
    try:
        served.refresh()
        replays = stats.graph_replays
        got, ref = served(pv, grid), _hf(tower, pv, grid)[0]
        assert stats.graph_replays == replays and stats.eager_batches >= 1
    finally:
        if how == "hook":
            handle.remove()
        elif how == "class forward":
            cls.forward = own
        else:
            del block.forward
    served.refresh()
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
    from vit_graph_backend.kernels import fused_ops as _fused

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
    from vit_graph_backend.adapters import serve as packed

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
    served = serve(tower, max_items_per_graph=1, max_budget=512, packed_attention=attention)
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
