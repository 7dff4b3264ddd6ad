"""``mark_layer_regions``: which layers it marks, that eager calls, pickles and copies are as
before, that Dynamo traces the marked layers as regions, and that compiled encoders with their
layers marked equal eager through the ``vitgraph`` backend (on CPU; tests/gpu for the graphs)."""

from __future__ import annotations

import copy
import pickle
import random

import pytest
import torch
from torch import nn

from test_backend import ATOL, MODELS, _tensors
from vit_graph_backend import _compat, mark_layer_regions
from vit_graph_backend.compile.backend import vitgraph
from vit_graph_backend.runtime.weights import python_outside_graphs


class Layer(nn.Module):
    def __init__(self, width: int = 16, index: int = 0) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x)).relu()


class IndexedLayer(Layer):
    """A layer whose computation reads a value of its own: no trace of it serves another."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x) * (self.index + 1)


class Inner(nn.Module):
    """A layer holding a stack of its own (not marked: only the outermost stack is)."""

    def __init__(self) -> None:
        super().__init__()
        self.parts = nn.ModuleList([Layer(), Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.parts:
            x = part(x)
        return x


class Encoder(nn.Module):
    def __init__(self, layer: type[nn.Module] = Layer, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList([layer(index=i) if layer is not Inner else layer()
                                     for i in range(depth)])
        self.head = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))   # torch.nn: left
        self.mixed = nn.ModuleList([Layer(), IndexedLayer()])             # two classes: left

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_marks_the_outermost_stack_of_one_class_defined_outside_torch():
    model = Encoder(Inner)
    assert mark_layer_regions(model) == 4
    assert all(type(layer) is not Inner and isinstance(layer, Inner) for layer in model.layers)
    assert type(model.layers[0]).__name__ == "Inner"
    assert all(type(part) is Layer for layer in model.layers for part in layer.parts)
    assert [type(m) for m in model.head] == [nn.Linear, nn.Linear]
    assert [type(m) for m in model.mixed] == [Layer, IndexedLayer]
    assert mark_layer_regions(model) == 0   # marked already


def test_a_model_that_is_itself_a_stack_has_only_its_own_layers_marked():
    model = nn.Sequential(Inner(), Inner(), Inner())
    assert mark_layer_regions(model) == 3
    assert all(type(part) is Layer for layer in model for part in layer.parts)


@torch.no_grad()
def test_a_forward_patched_into_the_class_after_marking_runs_and_is_seen(monkeypatch):
    """Marked layers run their class's ``forward`` as it is at each call; a served encoder's
    check reads the class's code, so a patch from another module is found."""
    torch.manual_seed(0)
    model, x = Encoder().eval(), torch.randn(2, 16)
    mark_layer_regions(model)
    monkeypatch.setattr(Layer, "forward", lambda self, x: x * 2)
    assert torch.equal(model.layers[0](x), x * 2)
    assert python_outside_graphs(model) is None   # the lambda is this module's, as Layer is
    monkeypatch.setattr(Layer, "forward", nn.Identity.forward)   # from another module
    assert "patched in from torch.nn.modules.linear" in python_outside_graphs(model)


def test_a_class_the_user_marked_is_left_as_it_is(monkeypatch):
    monkeypatch.setattr(Layer, "forward", torch.compiler.nested_compile_region(Layer.forward))
    model = Encoder()
    assert mark_layer_regions(model) == 0
    assert all(type(layer) is Layer for layer in model.layers)


@torch.no_grad()
def test_eager_calls_pickles_and_copies_are_as_before():
    torch.manual_seed(0)
    model, x = Encoder().eval(), torch.randn(3, 5, 16)
    want, keys = model(x), list(model.state_dict())
    assert mark_layer_regions(model) == 4
    assert torch.equal(model(x), want)
    assert list(model.state_dict()) == keys
    for back in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert all(type(layer) is Layer for layer in back.layers)   # unmarked
        assert torch.equal(back(x), want)


def test_a_marked_layer_is_not_read_as_patched_code(monkeypatch):
    """A served encoder checks its layers for patched code at capture (``runtime/weights.py``);
    a region runs its function unchanged, marked by this package or on the class by the user."""
    model = Encoder()
    mark_layer_regions(model)
    assert python_outside_graphs(model) is None
    monkeypatch.setattr(Layer, "forward", torch.compiler.nested_compile_region(Layer.forward))
    assert python_outside_graphs(Encoder()) is None
    monkeypatch.setattr(Layer, "forward", nn.Identity.forward)   # from another module
    assert "patched in from" in python_outside_graphs(Encoder())


def _traced(model: nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, torch.Tensor]:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.compiler.reset()
    out = torch.compile(model, backend=backend, fullgraph=True)(x)
    (gm,) = graphs
    return gm, out


@torch.no_grad()
def test_dynamo_calls_the_marked_layers_as_one_region():
    torch.manual_seed(0)
    model, x = Encoder(depth=6).eval(), torch.randn(2, 5, 16)
    want = model(x)
    mark_layer_regions(model)
    gm, out = _traced(model, x)
    torch.testing.assert_close(out, want)
    calls = _compat.nested_region_calls(gm)
    assert len(calls) == 1, calls   # one layer graph (some releases inline the first layer)
    assert len(next(iter(calls.values()))) >= 5


@torch.no_grad()
def test_a_layer_that_reads_a_value_of_its_own_is_traced_per_copy_not_refused():
    """PyTorch refuses a region traced more than 8 times in one graph; twelve layers that each
    read their own index need twelve traces."""
    torch.manual_seed(0)
    model, x = Encoder(IndexedLayer, depth=12).eval(), torch.randn(2, 16)
    want = model(x)
    mark_layer_regions(model)
    _, out = _traced(model, x)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("name", sorted(MODELS))
@torch.no_grad()
def test_compiled_encoders_with_marked_layers_match_eager(name, padded_cpu):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    assert mark_layer_regions(model) == 2
    torch.compiler.reset()
    compiled = torch.compile(model, backend="vitgraph", options={"max_budget": 8})
    rng = random.Random(2)
    for b in [3, 5, 1] + [rng.randint(1, 12) for _ in range(4)]:
        x = torch.randn(b, 3, 32, 32)
        for got, ref in zip(_tensors(compiled(x)), _tensors(model(x)), strict=True):
            torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    report = vitgraph.report()
    assert report["compiles"] <= 3, report
    assert report["stats"]["eager_items"] == 0, report["stats"]
    torch.compiler.reset()
