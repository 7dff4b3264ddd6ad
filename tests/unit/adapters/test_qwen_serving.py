"""Qwen-VL adapters' configuration and serving, on tiny random towers (float32, CPU): unsupported
modes and inputs refused with their numbers, adapters registered for subclasses, the runtime and
``serve()`` over the adapters, the fused graph path and its options against HF. The towers and
helpers: ``tests/qwen_towers.py``; equivalence with HF per call and per item:
``test_adapters_qwen.py``."""


from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

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
from vit_graph_backend import serve_vision_  # noqa: E402
from vit_graph_backend.adapters import (  # noqa: E402
    adapt,
    adapter_for,
    register_adapter,
    supported_classes,
)
from vit_graph_backend.adapters.qwen_families import (  # noqa: E402
    Qwen2_5_VLVisionAdapter,
    Qwen2VLVisionAdapter,
)
from vit_graph_backend.errors import (  # noqa: E402
    InvalidInputError,
    InvalidOptionError,
    UnsupportedModelError,
)
from vit_graph_backend.protocol import supports_encoder_cudagraph  # noqa: E402

from qwen_towers import (FAMILIES, GRAPH_ATOL, GRID_SETS, MAX_BUDGET, MIN_BUDGET,  # noqa: E402
                         _as_tuple, _assert_close, _hf, _hf_per_item, _inputs,
                         _qwen2, _qwen2_5)
from qwen_towers import towers  # noqa: E402, F401 (a fixture)


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
    # one registered class per family tower of tests/family_towers.py, and no other
    from family_towers import FAMILIES

    built = {f"{type(m).__module__}.{type(m).__qualname__}"
             for m in (build() for build, _, _ in FAMILIES.values())}
    assert {n for n in supported_classes() if n.startswith("transformers.")} == built


def test_adapt_returns_protocol_models_unchanged(towers):
    _, adapter = towers["qwen2"]
    assert adapt(adapter) is adapter
    assert adapt(adapter, max_budget=8) is adapter   # its options apply through the manager


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


def test_a_registered_subclass_runs_on_the_adapters_code():
    """Registering a subclass says the adapter's code is its own: its ``forward`` override is
    the user's code, not a patch inside the tower (the adapter serves it, no eager batch)."""
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
    from vit_graph_backend.runtime.manager import EncoderCudaGraphManager

    manager = EncoderCudaGraphManager(adapter, VitGraphOptions(
        max_items_per_graph=2, max_frames_per_batch=4), pad_without_graphs=True)
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

    from vit_graph_backend.kernels.fused_ops import rotate_qk
    from vit_graph_backend.adapters.qwen import _signed_sin

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
    from vit_graph_backend.kernels import fused_ops as _fused
    from vit_graph_backend.adapters import kernel_choices as _qwen_kernels

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
                                                                            monkeypatch, padded_cpu):
    """``torch.compile(serve(tower, inner_compiler=...), backend="vitgraph")``: the routing frame
    runs outside Dynamo (the vitgraph backend compiles nothing), and ``encoder_cudagraph_forward``
    is traced once for every budget (its row dimensions symbolic), not once per budget shape. A
    counting backend stands in for Inductor; outputs equal HF's per item."""
    from vit_graph_backend.adapters import serve as packed
    from vit_graph_backend.compile.backend import vitgraph

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
    from vit_graph_backend.kernels import fused_linear

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


def test_a_known_unserved_tower_is_refused_with_its_reason():
    # a class under the qualified name of transformers' MiniMax-M3-VL tower (no import needed)
    fake = type("MiniMaxM3VLVisionModel", (torch.nn.Module,), {})
    fake.__module__ = "transformers.models.minimax_m3_vl.modeling_minimax_m3_vl"
    with pytest.raises(UnsupportedModelError, match="depends on its batch mates"):
        adapt(fake())
    model = torch.nn.Module()
    model.visual = fake()
    with pytest.raises(UnsupportedModelError, match=r"MiniMaxM3VLVisionModel at visual: .*batch"):
        serve_vision_(model)


def test_every_registered_class_is_one_its_adapter_wraps():
    # the registry and the adapters' wrapped_class name each tower class twice: they must agree
    for name in supported_classes():
        if not name.startswith("transformers."):
            continue  # a class another test registered
        module, _, attribute = name.rpartition(".")
        fake = type(attribute, (torch.nn.Module,), {})
        fake.__module__ = module
        assert name in adapter_for(fake()).wrapped_class, name
