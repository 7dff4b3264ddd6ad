"""``batched.py``: serving Dynamo graphs of batched encoders, through the backend's public seams.

A small two-layer MLP over ``[B, D]`` rows and a conv net over ``[B, C, H, W]``, compiled with
``backend="vitgraph"``: ``static_graphs=False`` runs the static first compile eagerly (counted,
with its reason); graph sets for other dynamic sizes are bounded by ``max_graph_sets``, least
recently used first, and a set evicted and needed again still gives eager's outputs; rows above
the largest budget are served in chunks of it.
"""

from __future__ import annotations

import torch

from vit_graph_backend.compile.backend import vitgraph


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                               torch.nn.Linear(16, 4)).eval()


def _conv():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()).eval()


@torch.no_grad()
def test_static_graphs_false_runs_the_first_compile_eagerly():
    model = _mlp()
    compiled = torch.compile(model, backend="vitgraph", options={"static_graphs": False})
    x = torch.randn(3, 8)
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=1e-6)
    stats = vitgraph.report()["stats"]
    assert stats["eager_batches"] == 1 and stats["exact_shape_batches"] == 0
    assert any("static_graphs=False" in r for r in stats["fallback_reasons"])


@torch.no_grad()
def test_graph_sets_are_bounded_and_an_evicted_set_still_serves():
    model = _conv()
    compiled = torch.compile(model, backend="vitgraph", dynamic=True,
                             options={"max_graph_sets": 2})
    sizes = [8, 12, 16, 20, 8]   # the set for 8 is evicted, then needed again
    for i, side in enumerate(sizes):
        x = torch.randn(2 + i, 3, side, side)
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=1e-5)
        assert all(len(e.managers) <= 2 for e in vitgraph.encoders)
    assert sum(e.evictions for e in vitgraph.encoders) >= 1


@torch.no_grad()
def test_rows_above_the_largest_budget_are_served_in_chunks(padded_cpu):
    model = _mlp()
    compiled = torch.compile(model, backend="vitgraph", options={"budgets": [2, 4]})
    for rows in (3, 11):   # the first call is the static compile; 11 rows = 4 + 4 + 4 (3 real)
        x = torch.randn(rows, 8)
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=1e-6)
    stats = vitgraph.report()["stats"]
    assert stats["eager_batches"] == 0
    assert stats["batches_per_budget"].get("4", 0) >= 3 and stats["real_tokens"] == 3 + 11
