"""The worked example of ``docs/adapters.md`` runs as written and serves correctly.

The Python blocks of the document are executed in order; the last one asserts that the runtime's
per-item outputs equal the example model's own forward. A second check runs the reference dispatch
of ``tests/qwen_towers.py`` (NaN-poisoned static buffers) on the example model.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from qwen_towers import reference_dispatch

from vit_graph_backend.budgets import BudgetConfig
from vit_graph_backend.protocol import supports_encoder_cudagraph

DOC = Path(__file__).resolve().parents[3] / "docs" / "adapters.md"


def _run_document() -> dict:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    namespace: dict = {}
    for block in blocks:
        if "vl_model" in block:  # needs a real Qwen-VL checkpoint
            continue
        exec(compile(block, str(DOC), "exec"), namespace)
    return namespace


def test_worked_example_runs():
    namespace = _run_document()
    assert supports_encoder_cudagraph(namespace["model"])


def test_worked_example_under_the_reference_dispatch():
    namespace = _run_document()
    model, sizes = namespace["model"], namespace["sizes"]
    inputs = {"pixel_values": namespace["pixels"], "sizes": sizes}
    config = BudgetConfig.resolve(model.get_encoder_cudagraph_budget_range(), max_batch_size=3)
    with torch.no_grad():
        plan, actual = reference_dispatch(model, inputs, config)
        expected = model(inputs["pixel_values"], sizes).split(sizes.prod(-1).tolist())
    assert plan.eager_items == (2,)
    for (a,), e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
