"""``WeightSlots``: the per-call check that a served encoder's weights still live where its
graphs read them (``runtime/weights.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vit_graph_backend.runtime.weights import WeightSlots


def _model():
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))


@torch.no_grad()
@pytest.mark.parametrize("how", ["data", "assign", "table", "swap", "to", "buffer"])
def test_new_storage_anywhere_is_seen(how):
    model = _model()
    model[1].register_buffer("scale", torch.ones(4))
    slots = WeightSlots(model)
    assert not slots.moved()
    last = model[2]
    if how == "data":
        last.weight.data = last.weight.clone()
    elif how == "assign":
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    elif how == "table":  # accelerate's set_module_tensor_to_device writes the table itself
        last._parameters["bias"] = nn.Parameter(last.bias.clone())
    elif how == "swap":
        torch.utils.swap_tensors(last.weight, nn.Parameter(last.weight.clone()))
    elif how == "to":
        model.to(torch.float64)
    else:  # Module._apply writes buffers to their table directly
        model[1]._buffers["scale"] = model[1].scale.clone()
    assert slots.moved()


@torch.no_grad()
def test_a_new_tensor_over_the_same_storage_is_followed():
    """A slot given a new object over the same storage is no move (the graphs read the same
    memory), and that object's later moves are seen."""
    model = _model()
    slots = WeightSlots(model)
    last = model[2]
    last.weight = nn.Parameter(last.weight.data)
    assert not slots.moved()
    last.weight.data = last.weight.clone()
    assert slots.moved()


@torch.no_grad()
def test_in_place_writes_are_no_move():
    model = _model()
    slots = WeightSlots(model)
    model.load_state_dict({k: v * 2 for k, v in model.state_dict().items()})
    model[0].weight.add_(1)
    assert not slots.moved()


@torch.no_grad()
def test_a_deleted_or_emptied_slot_is_a_move():
    model = _model()
    slots = WeightSlots(model)
    model[2]._parameters["bias"] = None     # what nn.Module does for ``layer.bias = None``
    assert slots.moved()
    model = _model()
    slots = WeightSlots(model)
    del model[0].weight
    assert slots.moved()
