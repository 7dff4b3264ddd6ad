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

pytest.importorskip("transformers")

from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig  # noqa: E402
from transformers.models.qwen2_vl.modeling_qwen2_vl import (  # noqa: E402
    Qwen2VisionTransformerPretrainedModel,
)

import vit_graph_backend as vg  # noqa: E402
from vit_graph_backend.backend import vitgraph  # noqa: E402

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
    with pytest.raises(TypeError, match="give options or keyword options, not both"):
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
