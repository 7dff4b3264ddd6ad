"""``analyze_graph``: what the backend reads from a Dynamo graph of a batched encoder.

Graphs come from ``torch.compile`` with a recording backend, as the ``vitgraph`` backend receives
them: a static first compile, then a dynamic one after the batch size changes. Each case checks
the layout through its public attributes: batch inputs, the batch symbol's int, module state and
parameters, the reason graphs cannot serve it, and the batch-of-1 graph whose outputs lost the
symbol (``pinned``).
"""

from __future__ import annotations

import pytest
import torch

from vit_graph_backend.compile.layout import analyze_graph


def _layouts(fn, batches, shape=(4,), **compile_kwargs):
    seen = []

    def backend(gm, example_inputs):
        seen.append(analyze_graph(gm, example_inputs))
        return gm

    compiled = torch.compile(fn, backend=backend, **compile_kwargs)
    for b in batches:
        compiled(torch.randn(b, *shape))
    return seen


class _Linear(torch.nn.Module):
    def __init__(self, training_op=None):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)
        self.training_op = training_op

    def forward(self, x):
        y = self.proj(x)
        if self.training_op == "dropout":
            y = torch.nn.functional.dropout(y, 0.5, training=True)
        if self.training_op == "mean":
            y = y.mean(0, keepdim=True)   # mixes rows: padding would change it
        return y


def test_static_then_dynamic_batch_axis():
    static, dynamic = _layouts(_Linear(), [3, 5])
    assert static.batch_symbol is None and static.unsupported is None
    assert dynamic.batch_symbol is not None and dynamic.unsupported is None
    assert len(dynamic.batch_tensors) == 1 and dynamic.pinned is False
    assert dynamic.params and set(dynamic.params) <= set(dynamic.state)


@pytest.mark.parametrize("op,reason", [("dropout", "training-mode op dropout"),
                                       ("mean", "does not carry the batch axis at dim 0")])
def test_graphs_that_padding_would_change_are_refused_with_a_reason(op, reason):
    _, dynamic = _layouts(_Linear(op), [3, 5])
    assert dynamic.unsupported is not None and reason in dynamic.unsupported


def test_in_place_write_to_an_input_is_refused():
    def fn(x):
        x.add_(1)
        return x * 2

    _, dynamic = _layouts(fn, [3, 5])
    assert dynamic.unsupported is not None and "in-place write" in dynamic.unsupported


def test_a_batch_of_one_whose_output_lost_the_symbol_is_pinned():
    """With backed_size_oblivious the batch-1 compile can keep a symbolic batch axis while an
    output carries a concrete 1; such a graph is only valid for its own shapes."""
    from torch.fx.experimental import _config as fx_config

    def fn(x):
        if x.shape[0] != 1:   # a size check in the model, as nn.MultiheadAttention has
            return (x * 2,)
        return (x.sum(0, keepdim=True) * 2,)

    before = fx_config.backed_size_oblivious
    fx_config.backed_size_oblivious = True
    try:
        layouts = _layouts(fn, [3, 5, 1])
    finally:
        fx_config.backed_size_oblivious = before
    last = layouts[-1]
    if last.batch_symbol is None and not last.pinned:
        pytest.skip("this torch compiled the batch of 1 as a static graph")
    assert last.pinned and last.unsupported is None
    assert last.batch_tensors == [] and last.batch_symbol is None
