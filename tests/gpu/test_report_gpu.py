"""What ``report()`` says on a GPU, and the compile count with image-size changes, with graphs.

- a compiled timm ViT: the static first compile is one exact-shape graph (its rows counted, no
  budget "1"), the dynamic compile replays budget graphs; graph memory is positive;
- with the ``backed_size_oblivious`` opt-in, HF SigLIP at batch sizes 3, 5, 1: Dynamo's batch-of-1
  compile keeps a symbolic batch axis but outputs a concrete 1 (``nn.MultiheadAttention``'s size
  check); it is served as an exact-shape graph, not eagerly;
- with the opt-in, HF ViT with ``interpolate_pos_encoding=True`` over three image sizes, batch 1
  included: at most three compiles, outputs equal eager, every call served by a graph;
- a served Qwen2-VL tower's ``report()``: graph replays, graph memory, the same fields.
"""

from __future__ import annotations

import pytest
import torch

import vit_graph_backend
from vit_graph_backend.compile.backend import vitgraph
from vit_graph_backend.runtime.report import REPORT_FIELDS

pytestmark = pytest.mark.gpu

DEV = "cuda"
ATOL = 1e-4


@torch.no_grad()
def test_report_counts_exact_and_budget_graphs_truly():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                              patch_size=8, depth=2, num_classes=10).to(DEV).eval()
    compiled = torch.compile(model, backend="vitgraph", options={"budgets": [4, 16]})
    rows = [2, 5, 3, 7, 3]
    for b in rows:
        x = torch.randn(b, 3, 32, 32, device=DEV)
        torch.testing.assert_close(compiled(x), model(x), atol=1e-3, rtol=0)   # TF32 matmuls
    report = vit_graph_backend.report()
    stats = report["stats"]
    print("report on CUDA:", {k: report[k] for k in report if k != "stats"}, stats)
    assert report["cuda_graphs"] is True
    assert report["exact_shape_graphs"] == 1
    assert report["graphs_captured"] == 1 + 2 and report["captured_budgets"] == [4, 16]
    assert report["graph_memory_bytes"] > 0
    assert stats["graph_replays"] == len(rows) and stats["no_graph_batches"] == 0
    assert stats["exact_shape_batches"] == 1 and stats["real_tokens"] == sum(rows)
    assert set(stats["batches_per_budget"]) == {"4", "16"}
    assert stats["hit_rate"] == 1.0


@torch.no_grad()
def test_batch_of_one_with_a_pinned_output_is_served_from_a_graph():
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tr.SiglipVisionModel(tr.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8)).to(DEV).eval()
    compiled = torch.compile(model, backend="vitgraph",
                             options={"max_budget": 8, "backed_size_oblivious": True})
    for b in (3, 5, 1, 1, 4):
        x = torch.randn(b, 3, 32, 32, device=DEV)
        got, ref = compiled(x), model(x)
        torch.testing.assert_close(got.pooler_output, ref.pooler_output, atol=ATOL, rtol=0)
        torch.testing.assert_close(got.last_hidden_state, ref.last_hidden_state, atol=ATOL,
                                   rtol=0)
    report = vitgraph.report()
    print("siglip report:", report["compiles"], report["stats"])
    assert report["compiles"] <= 3
    assert report["stats"]["eager_batches"] == 0, report["stats"]["fallback_reasons"]
    assert report["stats"]["exact_shape_batches"] == 1 + 2   # first call, two batches of 1


@torch.no_grad()
def test_image_size_changes_cost_at_most_three_compiles_with_the_opt_in():
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tr.ViTModel(tr.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, image_size=32,
                                     patch_size=8)).to(DEV).eval()
    compiled = torch.compile(model, backend="vitgraph", options={"backed_size_oblivious": True})
    for b, size in [(3, 32), (5, 32), (2, 48), (4, 48), (1, 48), (1, 32), (6, 32), (2, 64)]:
        x = torch.randn(b, 3, size, size, device=DEV)
        got = compiled(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state
        ref = model(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    report = vitgraph.report()
    print("interpolate_pos_encoding report:", report["compiles"], report["stats"])
    assert report["compiles"] <= 3
    assert report["stats"]["eager_batches"] == 0 and report["stats"]["hit_rate"] == 1.0


@torch.no_grad()
def test_served_tower_report_on_cuda():
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    torch.manual_seed(0)
    # bf16: the packed graph's varlen flash attention needs half precision (qwen_vl.py)
    tower = Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(
        depth=1, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2,
        patch_size=2)).to(DEV, torch.bfloat16).eval()
    served = vit_graph_backend.serve(tower, min_budget=4, max_budget=16)
    grid = torch.tensor([[1, 4, 4], [1, 2, 4]])
    pixels = torch.randn(24, 24, device=DEV, dtype=torch.bfloat16)
    reference = tower(pixels, grid_thw=grid.to(DEV)).pooler_output   # merged tokens
    torch.testing.assert_close(served(pixels, grid), reference, atol=5e-2, rtol=5e-2)
    report = served.report()
    print("served report:", {k: report[k] for k in report if k != "stats"})
    assert set(report) == set(REPORT_FIELDS)
    assert report["graphs_captured"] >= 1 and report["graph_memory_bytes"] > 0
    assert report["stats"]["graph_replays"] >= 1 and report["stats"]["no_graph_batches"] == 0
