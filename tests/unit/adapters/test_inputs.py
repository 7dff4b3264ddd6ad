"""Bad call inputs of packed towers cost nothing and say why; ``serve()`` takes adapter keywords.

Tiny random HF Qwen2-VL and Qwen2.5-VL towers, float32, CPU (as in ``test_adapters_qwen``). A bad
``grid_thw`` or ``pixel_values`` raises :class:`InvalidInputError` (a ``ValueError``, not an
``InvalidOptionError``) from the item specs, which the runtime asks for first: no budget is
disabled and the next good call is served from its graph as before.
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
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig  # noqa: E402
from transformers.models.qwen2_vl.modeling_qwen2_vl import (  # noqa: E402
    Qwen2VisionTransformerPretrainedModel,
)

from toy_encoders import randomize_weights  # noqa: E402
import vit_graph_backend  # noqa: E402
from vit_graph_backend import VitGraphError, serve  # noqa: E402
from vit_graph_backend.adapters import adapt  # noqa: E402
from vit_graph_backend.errors import InvalidInputError, InvalidOptionError  # noqa: E402

PATCH, MERGE = 2, 2
PATCH_DIM = 3 * 2 * PATCH * PATCH  # channels * temporal patch * patch**2, as the configs below
GRAPH_ATOL = 5e-5  # graph path vs eager path on CPU: reordered float32 sums (test_adapters_qwen)


def _qwen2() -> torch.nn.Module:
    return randomize_weights(Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(
        depth=2, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2, patch_size=PATCH)), 0)


def _qwen2_5() -> torch.nn.Module:
    return randomize_weights(Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(
        depth=2, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=24,
        patch_size=PATCH, window_size=2 * MERGE * PATCH, fullatt_block_indexes=[1])), 1)


@pytest.fixture(scope="module")
def towers() -> dict[str, torch.nn.Module]:
    return {"qwen2": _qwen2(), "qwen2_5": _qwen2_5()}


def _pixels(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, PATCH_DIM, generator=torch.Generator().manual_seed(seed))


GOOD_GRID = [[1, 4, 4], [1, 2, 4]]  # 16 + 8 = 24 patches
GOOD_ROWS = 24

#: (id, pixel_values, grid_thw, what the message must name)
BAD_INPUTS = [
    ("empty grid", _pixels(0), torch.zeros(0, 3, dtype=torch.long),
     r"grid_thw of shape \(0, 3\) is invalid: it holds no item"),
    ("empty list grid", _pixels(0), [], r"grid_thw of shape \(0,\) is invalid: it holds no item"),
    ("1-D grid", _pixels(16), torch.tensor([1, 4, 4]),
     r"grid_thw of shape \(3,\) is invalid: must be shape \(items, 3\)"),
    ("3-D grid", _pixels(16), torch.tensor([[[1, 4, 4]]]),
     r"grid_thw of shape \(1, 1, 3\) is invalid"),
    ("grid of 4 columns", _pixels(16), torch.tensor([[1, 4, 4, 1]]),
     r"grid_thw of shape \(1, 4\) is invalid: must be shape \(items, 3\)"),
    ("float grid", _pixels(16), torch.tensor([[1.0, 4.0, 4.0]]),
     r"grid_thw of dtype torch.float32 is invalid: must be an integer tensor"),
    ("bool grid", _pixels(1), torch.ones(1, 3, dtype=torch.bool),
     r"grid_thw of dtype torch.bool is invalid: must be an integer tensor"),
    ("float list grid", _pixels(16), [[1, 4.5, 4]],
     r"grid_thw=\[\[1, 4.5, 4\]\] is invalid: t, h and w must be integers"),
    ("ragged list grid", _pixels(16), [[1, 4], [1, 4, 4]],
     r"grid_thw=\[\[1, 4\], \[1, 4, 4\]\] is invalid: must be a list of \[t, h, w\] rows"),
    ("string grid", _pixels(16), "1,4,4", r"grid_thw of type str is invalid"),
    ("float array grid", _pixels(16), torch.tensor([[1.0, 4.0, 4.0]]).numpy(),
     r"t, h and w must be integers"),
    ("odd height", _pixels(12), torch.tensor([[1, 3, 4]]),
     r"grid_thw\[0\]=\[1, 3, 4\] is invalid: .* multiples of spatial_merge_size=2"),
    ("zero frames", _pixels(16), torch.tensor([[1, 4, 4], [0, 4, 4]]),
     r"grid_thw\[1\]=\[0, 4, 4\] is invalid: t, h, w must be positive"),
    ("negative width", _pixels(16), torch.tensor([[1, 4, -4]]),
     r"grid_thw\[0\]=\[1, 4, -4\] is invalid: t, h, w must be positive"),
    ("20 rows for 16 patches", _pixels(20), torch.tensor([[1, 4, 4]]),
     r"pixel_values of shape \(20, 24\) does not match grid_thw \[\[1, 4, 4\]\]: "
     r"expected \(16, 24\)"),
    ("3-D pixel_values", _pixels(16).reshape(16, 24, 1), torch.tensor([[1, 4, 4]]),
     r"pixel_values of shape \(16, 24, 1\) does not match grid_thw"),
    ("1-D pixel_values", _pixels(16).flatten(), torch.tensor([[1, 4, 4]]),
     r"pixel_values of shape \(384,\) does not match grid_thw"),
    ("narrow pixel rows", _pixels(16)[:, :20], torch.tensor([[1, 4, 4]]),
     r"pixel_values of shape \(16, 20\) does not match .* expected \(16, 24\)"),
    ("integer pixel_values", torch.zeros(16, PATCH_DIM, dtype=torch.long),
     torch.tensor([[1, 4, 4]]), r"pixel_values of dtype torch.int64 is invalid"),
    ("pixel_values not a tensor", [[0.0] * PATCH_DIM] * 16, torch.tensor([[1, 4, 4]]),
     r"pixel_values of type list is invalid: must be a tensor"),
]


def test_invalid_input_error_is_a_value_error_and_no_option_error():
    assert issubclass(InvalidInputError, ValueError)
    assert issubclass(InvalidInputError, VitGraphError)
    assert not issubclass(InvalidInputError, InvalidOptionError)
    assert not issubclass(InvalidOptionError, InvalidInputError)
    assert vit_graph_backend.InvalidInputError is InvalidInputError
    assert "InvalidInputError" in vit_graph_backend.__all__


def _assert_input_error(info: pytest.ExceptionInfo) -> None:
    assert isinstance(info.value, ValueError)
    assert not isinstance(info.value, InvalidOptionError)


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5"])
@pytest.mark.parametrize(("pixels", "grid", "match"), [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_specs_reject_bad_inputs_naming_them(towers, family, pixels, grid, match):
    adapter = adapt(towers[family])
    with pytest.raises(InvalidInputError, match=match) as info:
        adapter.get_encoder_cudagraph_item_specs({"pixel_values": pixels, "grid_thw": grid})
    _assert_input_error(info)


@pytest.mark.parametrize(("pixels", "grid", "match"), [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_eager_forward_rejects_bad_inputs_naming_them(towers, pixels, grid, match):
    adapter = adapt(towers["qwen2_5"])
    with pytest.raises(InvalidInputError, match=match) as info, torch.no_grad():
        adapter(pixels, grid)
    _assert_input_error(info)


def test_missing_inputs_are_named(towers):
    adapter = adapt(towers["qwen2"])
    with pytest.raises(InvalidInputError, match=r"'pixel_values' is missing"):
        adapter.get_encoder_cudagraph_item_specs({"grid_thw": torch.tensor([[1, 4, 4]])})
    with pytest.raises(InvalidInputError, match=r"must be a mapping with 'pixel_values' and "
                                                 r"'grid_thw'"):
        adapter.get_encoder_cudagraph_item_specs({"pixel_values": _pixels(16)})


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5"])
def test_a_bad_call_disables_no_budget(towers, family):
    """20 pixel rows for a grid of 16 patches: refused up front, and the budget that a good call
    of the same grid replays stays served by its graph."""
    served = serve(towers[family], max_items_per_graph=2, min_budget=4, max_budget=48)
    grid = torch.tensor([[1, 4, 4]])
    with torch.no_grad():
        good = served(_pixels(16), grid)
        before = served.manager.stats.as_dict()
        replays = before["graph_replays"] + before["no_graph_batches"]
        with pytest.raises(InvalidInputError, match=r"expected \(16, 24\)") as info:
            served(_pixels(20), grid)
        _assert_input_error(info)
        again = served(_pixels(16), grid)
    report = served.manager.memory_report()
    assert report["disabled_budgets"] == {} and report["graphs_off_reason"] is None
    stats = served.manager.stats.as_dict()
    assert stats["graph_replays"] + stats["no_graph_batches"] == replays + 1
    assert stats["eager_batches"] == 0
    torch.testing.assert_close(again, good, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5"])
def test_a_list_grid_gives_the_tensor_grids_output(towers, family):
    tower = towers[family]
    adapter = adapt(tower)
    served = serve(tower, max_items_per_graph=2, min_budget=4, max_budget=48)
    pixels = _pixels(GOOD_ROWS, seed=3)
    tensor_grid = torch.tensor(GOOD_GRID)
    with torch.no_grad():
        eager = adapter(pixels, tensor_grid)
        hf = tower(pixels, tensor_grid).pooler_output
        from_list = adapter(pixels, GOOD_GRID)
        from_tuple = adapter(pixels, tuple(tuple(row) for row in GOOD_GRID))
        from_numpy = adapter(pixels, tensor_grid.numpy())
        served_tensor = served(pixels, tensor_grid)
        served_list = served(pixels, GOOD_GRID)
    torch.testing.assert_close(from_list, eager, rtol=0, atol=0)
    torch.testing.assert_close(from_tuple, eager, rtol=0, atol=0)
    torch.testing.assert_close(from_numpy, eager, rtol=0, atol=0)
    torch.testing.assert_close(served_list, served_tensor, rtol=0, atol=0)
    torch.testing.assert_close(served_list, eager, rtol=1e-5, atol=GRAPH_ATOL)
    torch.testing.assert_close(eager, hf, rtol=1e-5, atol=1e-5)
    specs = adapter.get_encoder_cudagraph_item_specs({"pixel_values": pixels,
                                                      "grid_thw": GOOD_GRID})
    # 4x4 and 2x4 patches at merge 2: 4 and 2 tokens
    assert [(s.input_size, s.output_tokens, s.frames) for s in specs] == [(16, 4, 1), (8, 2, 1)]


# -- serve(): one set of options, the adapters' fields among them ----------------------------------


def test_serve_hands_the_packed_fields_of_its_options_to_the_adapter(towers):
    served = serve(towers["qwen2_5"], fuse=False, align_mlp=False, max_items_per_graph=2,
                   min_budget=4, max_budget=48)
    assert served.encoder.fuse is False and served.encoder.align_mlp is False
    assert served.options.max_items_per_graph == 2
    assert (served.options.min_budget, served.options.max_budget) == (4, 48)
    assert served.manager.token_budgets[0] == 4 and served.manager.token_budgets[-1] == 48
    default = serve(towers["qwen2_5"])
    assert default.encoder.fuse is None and default.encoder.align_mlp is None


@pytest.mark.parametrize(("key", "hint"), [("fues", "fuse"), ("align_mpl", "align_mlp"),
                                           ("max_budgte", "max_budget")])
def test_serve_names_an_unknown_keyword_with_every_valid_one(towers, key, hint):
    with pytest.raises(InvalidOptionError, match=rf"{key!r} \(did you mean {hint!r}\?\)") as info:
        serve(towers["qwen2"], **{key: 1})
    for option in ("budgets", "max_items_per_graph", "inner_compiler", "fuse", "align_mlp",
                   "packed_attention"):
        assert option in str(info.value)
    assert isinstance(info.value, ValueError)


def test_serve_still_validates_option_values(towers):
    with pytest.raises(InvalidOptionError, match="fuse='yes'"):
        serve(towers["qwen2"], fuse="yes")
    with pytest.raises(InvalidOptionError, match="policy='fast'"):
        serve(towers["qwen2"], policy="fast")


def _counting_grid(rows: list[list[int]], reads: list[int]) -> torch.Tensor:
    real_tolist = torch.Tensor.tolist

    class CountingGrid(torch.Tensor):
        def tolist(self):
            reads.append(1)
            return real_tolist(self)

    return torch.tensor(rows).as_subclass(CountingGrid)


@pytest.mark.parametrize("inference", [False, True], ids=["no_grad", "inference_mode"])
def test_one_call_reads_its_grid_once_and_the_next_call_reads_it_again(towers, inference):
    """The runtime asks for a call's specs, then its buffers: with the serving layer's
    ``PackedCall`` the grid is read once (on CUDA every read is a sync that stalls the host). A
    later call is a new ``PackedCall`` and reads the grid again, so an in-place write between calls
    is seen, also under ``torch.inference_mode`` (whose tensors keep no version counter)."""
    from vit_graph_backend.adapters.inputs import PackedCall

    adapter = adapt(towers["qwen2_5"])
    reads: list[int] = []
    mode = torch.inference_mode() if inference else torch.no_grad()
    with mode:
        grid = _counting_grid(GOOD_GRID, reads)
        call = PackedCall(_pixels(GOOD_ROWS), grid)
        specs = adapter.get_encoder_cudagraph_item_specs(call)
        adapter.prepare_encoder_cudagraph_replay_buffers(call, [0, 1], 64)
        assert len(reads) == 1 and [s.output_tokens for s in specs] == [4, 2]
        grid[1, 2] = 2   # (1, 2, 2): 4 rows, 1 token; 20 rows in all, the pixels still 24
        with pytest.raises(InvalidInputError, match="does not match grid_thw"):
            adapter.get_encoder_cudagraph_item_specs(PackedCall(_pixels(GOOD_ROWS), grid))
        assert len(reads) == 2
        plain = {"pixel_values": _pixels(20), "grid_thw": grid}  # a plain mapping: no record
        adapter.get_encoder_cudagraph_item_specs(plain)
        adapter.get_encoder_cudagraph_item_specs(plain)
        assert len(reads) == 4


def test_served_calls_read_the_grid_once_each(towers):
    reads: list[int] = []
    served = serve(towers["qwen2"], min_budget=4, max_budget=64)
    with torch.no_grad():
        for _ in range(3):
            served(_pixels(GOOD_ROWS), _counting_grid(GOOD_GRID, reads))
    assert len(reads) == 3


def test_rows_given_with_the_call_are_checked_without_reading_the_grid(towers):
    """A list grid reaches the adapter as ``PackedCall.rows`` too (``PackedGraphEncoder``): the
    check reads those instead of the tensor, and they are checked the same way."""
    from vit_graph_backend.adapters.inputs import PackedCall

    adapter = adapt(towers["qwen2"])
    reads: list[int] = []
    grid = _counting_grid(GOOD_GRID, reads)
    call = PackedCall(_pixels(GOOD_ROWS), grid, [tuple(row) for row in GOOD_GRID])
    specs = adapter.get_encoder_cudagraph_item_specs(call)
    assert not reads and [s.output_tokens for s in specs] == [4, 2]
    bad = PackedCall(_pixels(GOOD_ROWS), grid, [(1, 3, 4), (1, 2, 4)])
    with pytest.raises(InvalidInputError, match=r"grid_thw\[0\]=\[1, 3, 4\] is invalid"):
        adapter.get_encoder_cudagraph_item_specs(bad)


def test_served_list_grids_are_never_read_back(towers, monkeypatch):
    served = serve(towers["qwen2"], min_budget=4, max_budget=64)
    reads: list[int] = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or real(self))
    with torch.no_grad():
        for _ in range(2):
            out = served(_pixels(GOOD_ROWS), [list(row) for row in GOOD_GRID])
        monkeypatch.undo()
        expected = served(_pixels(GOOD_ROWS), torch.tensor(GOOD_GRID))
    assert not reads
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
