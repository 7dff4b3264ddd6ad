"""What a user reads back is true, and a stream of image sizes costs at most three compiles.

- ``vit_graph_backend.report()`` (top level) and ``served.report()`` give the same fields; on a
  device without CUDA they claim no graph, no graph memory and no replay; Dynamo's static first
  compile is no budget "1"; real rows are counted as rows.
- HF ``ViTModel(..., interpolate_pos_encoding=True)`` over three image sizes, batch 1 included,
  automatic or ``dynamic=True``, costs the compiles the README states (at most three with the
  ``backed_size_oblivious`` opt-in), with outputs equal to eager, no eager batch and no warning
  about moved inputs (the model makes small tensors at every call).
"""

from __future__ import annotations

import gc

import logging

import pytest
import torch

import vit_graph_backend
from vit_graph_backend.compile.backend import vitgraph
from vit_graph_backend.runtime.report import REPORT_FIELDS

ATOL = 1e-4


def _timm_vit():
    timm = pytest.importorskip("timm")
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                             depth=2, num_classes=10).eval()


def _hf_vit():
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return tr.ViTModel(tr.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=64, image_size=32, patch_size=8)).eval()


def test_report_is_public_at_top_level_with_documented_fields():
    gc.collect()   # towers served by earlier tests, held only by reference cycles
    report = vit_graph_backend.report()
    assert "report" in vit_graph_backend.__all__
    assert set(report) == {"compiles", "fused_linear_activations", "served_towers",
                           *REPORT_FIELDS}
    assert report["compiles"] == 0 and report["stats"]["calls"] == 0
    assert report["fused_linear_activations"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a report says without CUDA")
@torch.no_grad()
def test_cpu_report_claims_no_graph_no_padding_and_counts_rows():
    model = _timm_vit()
    compiled = torch.compile(model, backend="vitgraph", options={"budgets": [4, 16]})
    rows = [2, 5, 3, 7]   # the first call is Dynamo's static compile, a batch of 2
    for b in rows:
        x = torch.randn(b, 3, 32, 32)
        torch.testing.assert_close(compiled(x), model(x), atol=ATOL, rtol=0)
    report = vit_graph_backend.report()
    stats = report["stats"]
    assert report["cuda_graphs"] is False
    assert (report["graphs_captured"], report["graph_memory_bytes"]) == (0, 0)
    assert report["captured_budgets"] == []
    assert (stats["graph_replays"], stats["graph_items"], stats["hit_rate"]) == (0, 0, 0.0)
    assert stats["no_graph_batches"] == len(rows) and stats["eager_batches"] == 0
    # no graphs, so nothing is padded for them: every batch ran at its own size
    assert stats["batches_per_budget"] == {} and report["static_input_bytes"] == 0
    assert stats["exact_shape_batches"] == 1
    assert stats["real_tokens"] == sum(rows)
    assert stats["padded_tokens"] == 0 and stats["padding_ratio"] == 0.0
    assert report == {**vitgraph.report(), "served_towers": report["served_towers"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a report says without CUDA")
def test_served_tower_report_has_the_same_fields():
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    tower = Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(
        depth=1, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2, patch_size=2)).eval()
    served = vit_graph_backend.serve(tower, min_budget=4, max_budget=16)
    grid = torch.tensor([[1, 4, 4], [1, 2, 4]])
    with torch.no_grad():
        served(torch.randn(24, 24), grid)
    report = served.report()
    assert set(report) == set(REPORT_FIELDS)
    assert (report["graphs_captured"], report["graph_memory_bytes"]) == (0, 0)
    assert report["stats"]["calls"] == 1 and report["stats"]["graph_replays"] == 0
    assert report["stats"]["no_graph_items"] == 2
    assert report["stats"]["real_tokens"] == 4 + 2   # merged tokens: 16 / 4 and 8 / 4
    total = vit_graph_backend.report()
    assert total["served_towers"] >= 1 and total["stats"]["calls"] >= 1


CALLS = [(3, 32), (5, 32), (2, 48), (4, 48), (1, 48), (1, 32), (6, 32), (2, 64), (1, 64)]


# the default run stays in the quick tier; the three variants ride in the full one (pyproject.toml)
@pytest.mark.parametrize("dynamic", [None, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["automatic", "dynamic=True"])
@pytest.mark.parametrize("oblivious,most", [(False, 5), pytest.param(True, 3, marks=pytest.mark.slow)],
                         ids=["default", "backed_size_oblivious"])
@torch.no_grad()
def test_image_size_changes_cost_the_documented_compiles(dynamic, oblivious, most, caplog):
    """README, "Compiles": static, dynamic, and one per size branch of the model (HF ViT's
    interpolate_pos_encoding) and per batch of 1; the opt-in folds the batches of 1 in."""
    model = _hf_vit()
    compiled = torch.compile(model, backend="vitgraph", dynamic=dynamic,
                             options={"backed_size_oblivious": oblivious})
    caplog.set_level(logging.WARNING, logger="vit_graph_backend")
    for b, size in CALLS:
        x = torch.randn(b, 3, size, size)
        got = compiled(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state
        ref = model(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    report = vitgraph.report()
    assert report["compiles"] <= most, report
    assert report["stats"]["eager_batches"] == 0, report["stats"]["fallback_reasons"]
    moved = [r.getMessage() for r in caplog.records if "changed address" in r.getMessage()]
    assert not moved, moved


@torch.no_grad()
def test_pytorch_setting_is_left_alone_by_default():
    from torch.fx.experimental import _config as fx_config

    fx_config.backed_size_oblivious = False   # conftest restores it after the test
    model = _timm_vit()
    compiled = torch.compile(model, backend="vitgraph")
    for b in (3, 5, 1):
        x = torch.randn(b, 3, 32, 32)
        torch.testing.assert_close(compiled(x), model(x), atol=ATOL, rtol=0)
    assert fx_config.backed_size_oblivious is False
    assert vitgraph.report()["compiles"] == 3   # static, dynamic, and one for the batch of 1


def test_backed_size_oblivious_needs_the_eager_inner_compiler():
    from vit_graph_backend import InvalidOptionError, VitGraphOptions

    with pytest.raises(InvalidOptionError, match="backed_size_oblivious=True is invalid with "
                                                 "inner_compiler='inductor'"):
        VitGraphOptions(backed_size_oblivious=True, inner_compiler="inductor")


def test_readme_documents_every_report_field():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme[readme.index("## What happened: `report()`"):]
    section = section[:section.index("\n## ", 1)]
    stats_fields = vit_graph_backend.GraphStats().as_dict()
    missing = [f for f in ("compiles", "served_towers", *REPORT_FIELDS, *stats_fields)
               if f"`{f}`" not in section]
    assert not missing, f"README's report() section does not name {missing}"
