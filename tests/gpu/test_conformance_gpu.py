"""``check_adapter`` on a GPU, in bf16 (marked ``gpu``): every built-in adapter over its family's
tiny tower (``tests/family_towers.py``) keeps the rules with CUDA graphs captured and replayed,
static buffers and the graph pool poisoned with NaN between calls (what needs the GPU: graphs,
pools, the CUDA kernels the adapters choose)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings

from family_towers import FAMILIES, tower  # skips without transformers
from vit_graph_backend.testing import check_adapter

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_built_in_adapter_keeps_the_rules_with_graphs(family):
    model = tower(family).to("cuda", torch.bfloat16)
    _, patch, frames = FAMILIES[family]
    check_adapter(model, max_side=8 * patch * 2, max_frames=frames, hypothesis_settings=settings(
        max_examples=6, deadline=None, database=None, suppress_health_check=list(HealthCheck)))
