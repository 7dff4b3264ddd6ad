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

from vit_graph_backend import fp8_linear, report  # noqa: E402
from vit_graph_backend.fp8_linear import (  # noqa: E402
    FP8_MIN_CAPABILITY,
    block_scaled_mm,
    fp8_linear_blocks,
    quantize_weight_blocks,
)

pytestmark = pytest.mark.gpu

OPTIONS = {"quantization": "fp8", "inner_compiler": "inductor", "max_budget": 8}


def _needs_fp8():
    if tuple(torch.cuda.get_device_capability()) < FP8_MIN_CAPABILITY:
        pytest.skip(f"{torch.cuda.get_device_name()} has no FP8 tensor cores")


def _needs_hopper():
    if tuple(torch.cuda.get_device_capability()) != (9, 0):
        pytest.skip(f"{torch.cuda.get_device_name()}: block-scaled FP8 runs on Hopper (9.0) only")


def _clip(seed, intermediate_size=1024):
    torch.manual_seed(seed)
    config = transformers.CLIPVisionConfig(hidden_size=256, intermediate_size=intermediate_size,
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


@pytest.mark.parametrize("rows", [4, 52, 1000])
def test_block_scaled_mm_contract_on_this_torch(rows):
    """``fp8_linear.block_scaled_mm``: small integers with a different power-of-two scale per
    block (exact in fp32), so a scale read from the wrong block or layout shows. K of 4 blocks
    and N of 3: ``torch._scaled_mm`` read such weight scales wrongly
    (``benchmarks/fp8_block_scale_layout_probe.py``)."""
    _needs_hopper()
    e4m3 = torch.float8_e4m3fn
    gen = torch.Generator(device="cuda").manual_seed(rows)
    a = torch.randint(-4, 5, (rows, 512), device="cuda", generator=gen).float()
    w = torch.randint(-4, 5, (384, 512), device="cuda", generator=gen).float()  # [N, K]
    scale_a = 2.0 ** torch.randint(-3, 4, (rows, 4), device="cuda", generator=gen).float()
    scale_w = 2.0 ** torch.randint(-3, 4, (3, 4), device="cuda", generator=gen).float()
    bias = torch.arange(384, device="cuda", dtype=torch.bfloat16) / 8
    out = block_scaled_mm(a.to(e4m3), w.to(e4m3).t(), scale_a.t().contiguous().t(),
                          scale_w.t(), bias)
    deq_a = a * scale_a.repeat_interleave(128, dim=1)
    deq_w = w * scale_w.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    expected = (deq_a @ deq_w.t() + bias.float()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 384)
    torch.testing.assert_close(out, expected, rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("shape", [(2, 289), (1, 1), (51,)])  # rows not multiples of 4
@torch.no_grad()
def test_fp8_linear_blocks_matches_fp32(shape):
    _needs_hopper()
    torch.manual_seed(3)
    x = torch.randn(*shape, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16) / 45
    b = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    q, scale = quantize_weight_blocks(w)
    got = fp8_linear_blocks(x, q, scale, b, torch.bfloat16)
    exact = torch.nn.functional.linear(x.float(), w.float(), b.float())
    err = _rel(got, exact)
    print(f"block-scaled fp8 linear vs fp32: max relative error {err:.3g}")
    assert got.shape == (*shape, 256) and err <= 5e-2
    assert err > 1e-3  # e4m3 really ran


@torch.no_grad()
def test_block_scaled_layers_in_graphs_are_as_close_to_fp32_as_row_scaled(caplog, monkeypatch):
    """An MLP 2,048 wide: fc2 block-scaled inside Inductor and the captured graphs, against the
    same model with every layer row-scaled, on the same inputs."""
    _needs_hopper()
    torch.compiler.reset()
    ref_model = _clip(4, intermediate_size=2048)
    model = copy.deepcopy(ref_model).to(torch.bfloat16)
    blocks = torch.compile(model, backend="vitgraph", options=OPTIONS)
    # other options than `blocks`' (warm-up runs only): Dynamo shares compiled frames between
    # torch.compile calls with equal options
    rows = torch.compile(copy.deepcopy(model), backend="vitgraph",
                         options={**OPTIONS, "warmup_iters": 2})
    errors = {"blocks": [], "rows": []}
    with caplog.at_level("INFO", logger="vit_graph_backend.fp8_linear"):
        for batch in (3, 8, 5, 3, 1):
            x = torch.randn(batch, 3, 64, 64, device="cuda")
            ref = ref_model(pixel_values=x).last_hidden_state
            errors["blocks"].append(_rel(blocks(pixel_values=x.bfloat16()).last_hidden_state,
                                         ref))
            with monkeypatch.context() as patch:  # compiles (if it does) with rows only
                patch.setattr(fp8_linear, "scaling_for", lambda shape, device: "rows")
                out = rows(pixel_values=x.bfloat16()).last_hidden_state
            errors["rows"].append(_rel(out, ref))
    assert "(4 of them block-scaled)" in caplog.text, caplog.text  # the 4 layers' fc2
    assert "(0 of them block-scaled)" in caplog.text, caplog.text  # the row-scaled compile
    stats = report()["stats"]
    print(f"fp8 vs fp32, max relative error: block-scaled fc2 {max(errors['blocks']):.3g}, "
          f"row-scaled {max(errors['rows']):.3g}; stats {stats}")
    assert max(errors["blocks"]) <= 1.2 * max(errors["rows"]) + 5e-3
    assert max(errors["blocks"]) <= 8e-2
    assert stats["graph_replays"] >= 6 and stats["eager_batches"] == 0, stats
    torch.compiler.reset()
