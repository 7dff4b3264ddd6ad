"""The package copied and imported under another name serves with its own code: its adapter
registry and its code watch name the package by ``__name__`` (``adapters/__init__.py``,
``code_watch.py``), so a vendored copy, or the baseline tree of
``benchmarks/ab_trees.py``, is not served by the installed package's adapters
(whose buffers its runtime would not know: wrong numbers) nor runs eagerly because its code looks
like a patch. In a subprocess: two copies in one process share the ``vitgraph::`` custom ops."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import vit_graph_backend  # noqa: E402

_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import relocated_vgb as pkg
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel)
torch.manual_seed(0)
tower = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(
    depth=2, hidden_size=32, num_heads=2, intermediate_size=44, out_hidden_size=16, patch_size=2,
    spatial_merge_size=2, window_size=8, fullatt_block_indexes=[1], temporal_patch_size=2,
    in_channels=3)).eval()
served = pkg.serve(tower, min_budget=4, max_budget=64)
pixels, grid = torch.randn(32, 24), [[1, 4, 8]]
with torch.inference_mode():
    expected = tower(pixels, grid_thw=torch.tensor(grid)).pooler_output
    got = served(pixels, grid)
stats = served.manager.stats
print(type(served.encoder).__module__, (got - expected).abs().max().item(), stats.eager_items,
      dict(stats.fallback_reasons))
"""


@pytest.mark.slow
def test_a_copy_under_another_name_serves_with_its_own_adapter_and_code(tmp_path):
    shutil.copytree(Path(vit_graph_backend.__file__).parent, tmp_path / "relocated_vgb")
    run = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    module, error, eager, reasons = run.stdout.strip().splitlines()[-1].split(" ", 3)
    assert module == "relocated_vgb.adapters.qwen_families"
    assert float(error) < 1e-5
    assert eager == "0", reasons
