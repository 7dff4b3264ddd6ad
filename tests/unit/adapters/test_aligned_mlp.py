"""Zero-padded MLP weight copies (``align_mlp``) on CPU, float32: same numbers as the HF tower,
kept in step when the tower's weights change, padded storage never moved (a captured graph reads
it), and a clear error for a bad value.

The tiny Qwen2.5-VL tower here has ``intermediate_size=42`` (not a multiple of 8, like the real
3420), so ``align_mlp=True`` pads it to 48 with ``epilogue_fusion="off"``; with the default
``"auto"`` its gate and up weights are one packed copy, 2 x 128 rows (``fused_linear.pack_gated``),
which the plain path reads as one GEMM and two views, and the graph path through
``fused_linear.linear_silu_mul`` (PyTorch's ops on CPU). Tolerance: padding adds exact zeros,
but a wider GEMM may sum in another order: float32 outputs of magnitude ~10 agree to 1e-5
(measured ~2e-6).
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
from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionMlp  # noqa: E402
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig  # noqa: E402
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionMLP  # noqa: E402

from vit_graph_backend.adapters import adapt  # noqa: E402
from vit_graph_backend.adapters.aligned_mlp import AlignedMLPs  # noqa: E402
from vit_graph_backend.errors import InvalidOptionError  # noqa: E402
from vit_graph_backend.adapters.serve import PackedGraphEncoder  # noqa: E402

PATCH, MERGE, HIDDEN, WIDTH, DEPTH = 2, 2, 32, 42, 2
ATOL = 1e-5


def _tower(seed: int = 0) -> torch.nn.Module:
    model = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(
        depth=DEPTH, hidden_size=HIDDEN, intermediate_size=WIDTH, num_heads=2, out_hidden_size=24,
        patch_size=PATCH, window_size=2 * MERGE * PATCH, fullatt_block_indexes=[1]))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model.eval()


def _call(grids, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, 3 * 2 * PATCH * PATCH, generator=gen), torch.tensor(grids)


GRIDS = [(1, 4, 4), (1, 8, 4), (2, 4, 8)]


@torch.no_grad()
def test_padded_mlp_matches_the_hf_tower_and_holds_the_expected_bytes():
    hf = _tower()
    adapter = adapt(hf, align_mlp=True, epilogue_fusion="off")
    pv, grid = _call(GRIDS)
    torch.testing.assert_close(adapter(pv, grid), hf(pv, grid).pooler_output, atol=ATOL, rtol=0)
    # per block: gate and up (48 x 32 weight + 48 bias each), down (32 x 48 weight; its bias
    # needs no padding and is read from the module)
    per_block = 2 * (48 * HIDDEN + 48) + HIDDEN * 48
    assert adapter.aligned_mlp_bytes == DEPTH * per_block * 4
    for weights in adapter.kernels.aligned.weights:  # the padding itself is zero
        for weight, bias in weights.ins:
            assert not weight[WIDTH:].any() and not bias[WIDTH:].any()
        assert not weights.out_weight[:, WIDTH:].any()
    # the adapter really reads the copies: nudge one (the tower is unchanged, so no refresh)
    adapter.kernels.aligned.weights[0].out_weight[:, :WIDTH].add_(1.0)
    assert not torch.allclose(adapter(pv, grid), hf(pv, grid).pooler_output, atol=1e-2)


@torch.no_grad()
def test_packed_gate_up_copy_matches_the_hf_tower_on_both_paths():
    hf = _tower()
    adapter = adapt(hf, align_mlp=True)   # epilogue_fusion="auto": a SiLU-gated MLP is packed
    assert adapter.kernels.epilogue == "silu_mul" and adapter.kernels.aligned.gated
    pv, grid = _call(GRIDS)
    torch.testing.assert_close(adapter(pv, grid), hf(pv, grid).pooler_output, atol=ATOL, rtol=0)
    # per block: packed gate/up (256 x 32 weight + 256 bias), down (32 x 128 weight)
    per_block = (256 * HIDDEN + 256) + HIDDEN * 128
    assert adapter.aligned_mlp_bytes == DEPTH * per_block * 4
    for block, weights in zip(hf.blocks, adapter.kernels.aligned.weights):
        ((weight, bias),) = weights.ins
        mlp = block.mlp
        for rows, proj in ((slice(0, 128), mlp.gate_proj), (slice(128, 256), mlp.up_proj)):
            assert torch.equal(weight[rows][:WIDTH], proj.weight)      # chunk 0: gate, then up
            assert torch.equal(bias[rows][:WIDTH], proj.bias)
            assert not weight[rows][WIDTH:].any() and not bias[rows][WIDTH:].any()
        assert not weights.out_weight[:, WIDTH:].any()
    # the graph path runs the op (PyTorch's ops here) on the same copy: same numbers as HF
    served = PackedGraphEncoder(adapt(hf, align_mlp=True, fuse=True), max_items_per_graph=2,
                                budgets=[16, 64])
    torch.testing.assert_close(served(pv, grid), hf(pv, grid).pooler_output, atol=ATOL, rtol=0)


@torch.no_grad()
def test_auto_mode_pads_only_on_cuda_and_false_never():
    hf = _tower()
    pv, grid = _call(GRIDS[:1])
    auto, off = adapt(hf), adapt(hf, align_mlp=False)
    for adapter in (auto, off):
        torch.testing.assert_close(adapter(pv, grid), hf(pv, grid).pooler_output, atol=ATOL,
                                   rtol=0)
        assert adapter.aligned_mlp_bytes == 0  # CPU: auto does not pad


@torch.no_grad()
def test_copies_follow_in_place_writes_and_replaced_parameters_without_moving():
    hf = _tower()
    adapter = adapt(hf, align_mlp=True)
    pv, grid = _call(GRIDS)
    adapter(pv, grid)
    pointers = [w.out_weight.data_ptr() for w in adapter.kernels.aligned.weights]
    hf.blocks[0].mlp.gate_proj.weight.mul_(-2.0)                          # written in place
    hf.blocks[1].mlp.down_proj.weight = torch.nn.Parameter(                # replaced
        torch.randn(HIDDEN, WIDTH) * 0.2)
    hf.blocks[1].mlp.up_proj.bias.add_(0.5)
    torch.testing.assert_close(adapter(pv, grid), hf(pv, grid).pooler_output, atol=ATOL, rtol=0)
    assert [w.out_weight.data_ptr() for w in adapter.kernels.aligned.weights] == pointers


@torch.no_grad()
@pytest.mark.parametrize("epilogue_fusion", ["auto", "off"])  # packed gate/up copy, or two
def test_copies_follow_parameters_written_into_their_modules_tables(epilogue_fusion):
    """accelerate's ``set_module_tensor_to_device`` (Hugging Face loading with a ``device_map``)
    replaces a parameter by writing ``module._parameters[name]``, which no registration hook
    sees; ``p.data = t`` gives a parameter new storage in place. Both are followed."""
    hf = _tower()
    adapter = adapt(hf, align_mlp=True, epilogue_fusion=epilogue_fusion)
    pv, grid = _call(GRIDS)
    adapter(pv, grid)
    pointers = [w.out_weight.data_ptr() for w in adapter.kernels.aligned.weights]
    mlp0, mlp1 = hf.blocks[0].mlp, hf.blocks[1].mlp
    mlp1.down_proj._parameters["weight"] = torch.nn.Parameter(torch.randn(HIDDEN, WIDTH) * 0.2)
    mlp0.gate_proj._parameters["bias"] = torch.nn.Parameter(torch.randn(WIDTH) * 0.2)
    torch.testing.assert_close(adapter(pv, grid), hf(pv, grid).pooler_output, atol=ATOL, rtol=0)
    mlp0.up_proj.weight.data = torch.randn(WIDTH, HIDDEN) * 0.2   # checked apart: any change
    torch.testing.assert_close(adapter(pv, grid), hf(pv, grid).pooler_output, atol=ATOL, rtol=0)
    assert [w.out_weight.data_ptr() for w in adapter.kernels.aligned.weights] == pointers


@torch.no_grad()
@pytest.mark.parametrize("epilogue_fusion", ["auto", "off"])
def test_a_bias_removed_or_added_later_is_followed(epilogue_fusion):
    hf = _tower()
    adapter = adapt(hf, align_mlp=True, epilogue_fusion=epilogue_fusion)
    pv, grid = _call(GRIDS)
    adapter(pv, grid)
    hf.blocks[0].mlp.gate_proj.bias = None   # registered as None: no registration hook runs
    hf.blocks[1].mlp.up_proj.register_parameter("bias", None)
    torch.testing.assert_close(adapter(pv, grid), hf(pv, grid).pooler_output, atol=ATOL, rtol=0)
    hf.blocks[1].mlp.up_proj.bias = torch.nn.Parameter(torch.randn(WIDTH) * 0.2)
    torch.testing.assert_close(adapter(pv, grid), hf(pv, grid).pooler_output, atol=ATOL, rtol=0)


@torch.no_grad()
def test_copies_follow_a_conversion_that_overwrites_the_parameters():
    """With ``torch.__future__.set_overwrite_module_params_on_conversion(True)``, ``.double()``
    puts new Parameter objects into every module's table directly."""
    hf = _tower()
    adapter = adapt(hf, align_mlp=True)
    pv, grid = _call(GRIDS)
    adapter(pv, grid)
    before = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        hf.double()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(before)
    pv = pv.double()
    got = adapter(pv, grid)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, hf(pv, grid).pooler_output, atol=ATOL, rtol=0)


@torch.no_grad()
def test_served_graph_path_uses_the_padded_weights_and_follows_new_weights():
    hf = _tower()
    served = PackedGraphEncoder(adapt(hf, align_mlp=True), max_items_per_graph=2, budgets=[16, 64])
    pv, grid = _call(GRIDS)
    torch.testing.assert_close(served(pv, grid), hf(pv, grid).pooler_output, atol=ATOL, rtol=0)
    stats = served.manager.stats
    assert stats.graph_items + stats.no_graph_items == len(GRIDS)
    hf.blocks[0].mlp.down_proj.bias.mul_(3.0)
    torch.testing.assert_close(served(pv, grid), hf(pv, grid).pooler_output, atol=ATOL, rtol=0)
    served.encoder.kernels.aligned.weights[1].ins[0][1].add_(1.0)  # the graph path reads the copies
    assert not torch.allclose(served(pv, grid), hf(pv, grid).pooler_output, atol=1e-2)


def _replace(hf: torch.nn.Module, other: torch.nn.Module, how: str) -> None:
    """Put ``other``'s modules (made before the adapter, so only assignment registers them) into
    ``hf``'s place, one way ``how``."""
    if how == "mlp":                       # assignment: a registration
        hf.blocks[1].mlp = other.blocks[1].mlp
    elif how == "block":
        hf.blocks[1] = other.blocks[1]
    elif how == "block table":             # no hook fires (torch.ao's convert writes this way)
        hf.blocks._modules["1"] = other.blocks[1]
    elif how == "linear table":
        hf.blocks[0].mlp._modules["up_proj"] = other.blocks[0].mlp.up_proj
    elif how == "activation":              # SiLU to GELU in one block: no more silu(gate) * up
        hf.blocks[1].mlp.act_fn = torch.nn.GELU()
    else:
        hf.blocks[0].mlp._modules["act_fn"] = torch.nn.Tanh()


SWAPS = ["mlp", "block", "block table", "linear table", "activation", "activation table"]


@torch.no_grad()
@pytest.mark.parametrize("served", [False, True], ids=["adapter", "served"])
@pytest.mark.parametrize("epilogue_fusion", ["auto", "off"])
@pytest.mark.parametrize("how", SWAPS)
def test_a_replaced_mlp_block_linear_or_activation_is_followed(how, epilogue_fusion, served):
    """The copies and the MLP's fused op are made from the MLP modules: a module replaced after
    the adapter was built, by assignment or by a write to a module table, is what calls compute
    with once ``refresh()`` announces it (``weights.py``: the contract), on the adapter's own
    path and on the served graph path (PyTorch's ops here)."""
    hf, other = _tower(), _tower(seed=1)
    adapter = adapt(hf, align_mlp=True, fuse=True, epilogue_fusion=epilogue_fusion)
    run = (PackedGraphEncoder(adapter, max_items_per_graph=2, budgets=[16, 64]) if served
           else adapter)
    pv, grid = _call(GRIDS)
    torch.testing.assert_close(run(pv, grid), hf(pv, grid).pooler_output, atol=ATOL, rtol=0)
    _replace(hf, other, how)
    run.refresh()
    want = hf(pv, grid).pooler_output
    torch.testing.assert_close(run(pv, grid), want, atol=ATOL, rtol=0)
    if how.startswith("activation"):  # no longer one SiLU-gated kind: the fused op is off
        assert adapter.kernels.epilogue is None


@torch.no_grad()
@pytest.mark.parametrize("kind", ["fc1/fc2 (Qwen2-VL)", "linear_fc1/fc2 (Qwen3-VL)"])
def test_plain_mlp_shapes_pad_to_the_same_numbers(kind):
    torch.manual_seed(0)
    if kind.startswith("fc1"):
        mlps = [VisionMlp(HIDDEN, WIDTH, "quick_gelu") for _ in range(2)]
    else:
        cfg = Qwen3VLVisionConfig(hidden_size=HIDDEN, intermediate_size=WIDTH)
        mlps = [Qwen3VLVisionMLP(cfg) for _ in range(2)]
    assert AlignedMLPs.needed(mlps)
    aligned = AlignedMLPs(mlps)
    assert aligned.refresh() and not aligned.refresh()  # second refresh: nothing changed
    assert aligned.padded_width == 48
    x = torch.randn(7, HIDDEN)
    for layer, mlp in enumerate(mlps):
        torch.testing.assert_close(aligned.forward(layer, x), mlp(x), atol=ATOL, rtol=0)


def test_aligned_widths_need_no_copy_and_bad_values_are_refused():
    assert not AlignedMLPs.needed([VisionMlp(HIDDEN, 48, "quick_gelu")])
    with pytest.raises(InvalidOptionError, match=r"align_mlp='yes' is invalid: must be True, "
                                                 r"False or None"):
        adapt(_tower(), align_mlp="yes")
    with pytest.raises(ValueError, match="one known shape"):
        AlignedMLPs([torch.nn.Linear(2, 2)])


def test_a_tower_built_under_inference_mode_runs_its_own_mlps(caplog):
    """Inference tensors keep no version counter, so an in-place write to them could not reach
    the padded copies: the adapter says so once and runs the tower's own MLPs (right numbers),
    instead of failing every call."""
    import logging

    from vit_graph_backend.adapters import adapt

    with torch.inference_mode():
        torch.manual_seed(0)
        tower = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(
            depth=2, hidden_size=32, intermediate_size=44, num_heads=2, out_hidden_size=24,
            patch_size=2, window_size=8, fullatt_block_indexes=[1])).eval()
        adapter = adapt(tower, align_mlp=True)  # padded copies asked for, on CPU too
        grid = torch.tensor([[1, 4, 6]])
        pixels = torch.randn(24, 3 * 2 * 2 * 2)
        with caplog.at_level(logging.WARNING):
            got = adapter(pixels, grid)
        expected = tower(pixels, grid).pooler_output
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not adapter.kernels.use_aligned and adapter.aligned_mlp_bytes == 0
    assert "inference tensors" in adapter.kernels.untracked
    assert "padded MLP weights off" in caplog.text


def _pinned(hf: torch.nn.Module):
    """An adapter over ``hf`` with its copies made and pinned, as a capture on CUDA pins them
    (a capture on CPU has no graph, so it does not)."""
    adapter = adapt(hf, align_mlp=True)
    adapter.kernels.sync(torch.device("cpu"), capture=True)
    assert not adapter.kernels.aligned.pinned
    adapter.kernels.aligned.pinned = True
    return adapter