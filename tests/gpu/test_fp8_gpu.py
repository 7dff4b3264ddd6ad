"""``quantization="fp8"`` on a GPU with FP8 tensor cores (marked ``gpu``): a small HF CLIP vision
tower in bf16 through ``torch.compile(backend="vitgraph")`` with Inductor inside the graphs.

Outputs are compared with the same model in fp32 (error printed beside bf16's), every call
replays a captured graph, and new weights loaded in place after capture reach the captured
graphs through the re-quantized buffers.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vit_graph_backend import report  # noqa: E402
from vit_graph_backend.fp8_linear import FP8_MIN_CAPABILITY  # noqa: E402

pytestmark = pytest.mark.gpu

OPTIONS = {"quantization": "fp8", "inner_compiler": "inductor", "max_budget": 8}


def _needs_fp8():
    if tuple(torch.cuda.get_device_capability()) < FP8_MIN_CAPABILITY:
        pytest.skip(f"{torch.cuda.get_device_name()} has no FP8 tensor cores")


def _clip(seed):
    torch.manual_seed(seed)
    config = transformers.CLIPVisionConfig(hidden_size=256, intermediate_size=1024,
                                           num_hidden_layers=4, num_attention_heads=4,
                                           image_size=64, patch_size=16)
    return transformers.CLIPVisionModel(config).cuda().eval()


def _rel(out, ref):
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


@torch.no_grad()
def test_fp8_graphs_stay_close_to_fp32_and_replay():
    _needs_fp8()
    torch.compiler.reset()
    ref_model = _clip(0)
    model = copy.deepcopy(ref_model).to(torch.bfloat16)
    fn = torch.compile(model, backend="vitgraph", options=OPTIONS)
    errors, bf16_errors = [], []
    for rows in (3, 8, 5, 3):
        x = torch.randn(rows, 3, 64, 64, device="cuda")
        ref = ref_model(pixel_values=x).last_hidden_state
        out = fn(pixel_values=x.bfloat16()).last_hidden_state
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        errors.append(_rel(out, ref))
        bf16_errors.append(_rel(model(pixel_values=x.bfloat16()).last_hidden_state, ref))
    stats = report()["stats"]
    print(f"fp8 vs fp32: max relative error {max(errors):.3g} (bf16 eager {max(bf16_errors):.3g});"
          f" stats {stats}")
    assert max(errors) <= 5e-2
    assert max(errors) > max(bf16_errors)  # FP8 really ran: coarser than bf16
    assert stats["graph_replays"] >= 2 and stats["eager_batches"] == 0, stats
    torch.compiler.reset()


@torch.no_grad()
def test_weights_loaded_after_capture_reach_the_graphs():
    _needs_fp8()
    torch.compiler.reset()
    model = _clip(1).to(torch.bfloat16)
    fn = torch.compile(model, backend="vitgraph", options=OPTIONS)
    x = torch.randn(4, 3, 64, 64, device="cuda")
    for _ in range(3):  # the dynamic graph and its captures
        fn(pixel_values=x.bfloat16())
        fn(pixel_values=torch.randn(6, 3, 64, 64, device="cuda", dtype=torch.bfloat16))
    new = _clip(2)
    model.load_state_dict(new.state_dict())  # in place: same storages, new values
    out = fn(pixel_values=x.bfloat16()).last_hidden_state
    ref = new(pixel_values=x).last_hidden_state
    err = _rel(out, ref)
    print(f"after load_state_dict: max relative error vs the new fp32 weights {err:.3g}")
    assert err <= 5e-2
    assert report()["stats"]["graph_replays"] >= 3
    torch.compiler.reset()


@torch.no_grad()
def test_a_second_compile_comes_from_the_cache_and_reads_its_own_weights(tmp_path, monkeypatch):
    """On CUDA, where ``fp8_linear`` runs ``torch._scaled_mm``: the second model's compile (same
    shapes, other weights) is an AOTAutograd cache hit, not a bypass, and its graphs give that
    model's results, also after new weights are loaded in place."""
    from compile_caches import cache_outcomes

    _needs_fp8()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    counts = []
    x = torch.randn(4, 3, 64, 64, device="cuda")
    for seed in (3, 4):
        torch.compiler.reset()
        ref_model = _clip(seed)
        model = copy.deepcopy(ref_model).to(torch.bfloat16)
        with cache_outcomes() as outcomes:
            fn = torch.compile(model, backend="vitgraph", options=OPTIONS)
            for rows in (4, 6, 4):
                xi = x if rows == 4 else torch.randn(rows, 3, 64, 64, device="cuda")
                out = fn(pixel_values=xi.bfloat16()).last_hidden_state
                assert _rel(out, ref_model(pixel_values=xi).last_hidden_state) <= 5e-2
        counts.append(outcomes)
    new = _clip(5)
    model.load_state_dict(new.state_dict())
    err = _rel(fn(pixel_values=x.bfloat16()).last_hidden_state,
               new(pixel_values=x).last_hidden_state)
    stats = report()["stats"]
    torch.compiler.reset()
    print(f"fp8 compile cache: first model {counts[0]}, second {counts[1]}; after "
          f"load_state_dict {err:.3g}; stats {stats}")
    assert counts[0].get("autograd_cache_bypass", 0) == 0 and counts[0], counts
    assert counts[1].get("autograd_cache_hit", 0) >= 1, counts
    assert counts[1].get("autograd_cache_bypass", 0) == 0, counts
    assert err <= 5e-2
    assert stats["graph_replays"] >= 2, stats
