"""Host staging of packed metadata (``adapters/_staging.py``), on CPU.

What the GPU adds (pinned blocks, copies that do not wait for a busy GPU, results still right)
is checked in ``tests/gpu/test_packed_gpu.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vit_graph_backend.adapters import _staging
from vit_graph_backend.adapters._staging import HostStage, upload
from vit_graph_backend.errors import UnsupportedGraphError

CPU = torch.device("cpu")


def _values() -> dict[str, torch.Tensor]:
    return {"position_ids": torch.arange(10, dtype=torch.int64).reshape(5, 2) + 1,
            "frame_seqlens": torch.tensor([3, 2], dtype=torch.int32),
            "weights": torch.full((5, 4), 0.5)}


SHAPES = {"position_ids": (8, 2), "frame_seqlens": (4,), "weights": (7, 4)}


def test_a_stage_pads_each_buffer_with_zeros_to_its_shape():
    staged = HostStage(_values(), SHAPES).pinned(CPU)
    assert set(staged) == set(SHAPES)
    for key, value in _values().items():
        out = staged[key]
        assert out.shape == SHAPES[key] and out.dtype == value.dtype
        n = value.shape[0]
        assert torch.equal(out[:n], value)
        assert not out[n:].any(), key


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4)), min_size=1, max_size=4))
@settings(max_examples=40, deadline=None)
def test_padding_never_mixes_buffers_of_one_dtype(sizes):
    """Buffers of one dtype share a block: each keeps its own values and zeros, whatever the
    lengths (a wrong offset into the block would show up in a neighbour)."""
    values, shapes = {}, {}
    for i, (rows, extra) in enumerate(sizes):
        values[f"b{i}"] = torch.arange(rows * 3, dtype=torch.int64).reshape(rows, 3) + 100 * (i + 1)
        shapes[f"b{i}"] = (rows + extra, 3)
    staged = HostStage(values, shapes).pinned(CPU)
    for key, value in values.items():
        expected = torch.zeros(shapes[key], dtype=torch.int64)
        expected[:value.shape[0]] = value
        assert torch.equal(staged[key], expected), key


def test_a_longer_buffer_or_other_width_is_refused_with_its_shapes():
    with pytest.raises(UnsupportedGraphError, match=r"'frame_seqlens' of shape \(2,\).*\(1,\)"):
        HostStage(_values(), {**SHAPES, "frame_seqlens": (1,)})
    with pytest.raises(UnsupportedGraphError, match=r"'weights' of shape \(5, 4\).*\(7, 3\)"):
        HostStage(_values(), {**SHAPES, "weights": (7, 3)})


def test_upload_keeps_values_shapes_and_dtypes():
    out = upload(_values(), CPU)
    for key, value in _values().items():
        assert torch.equal(out[key], value) and out[key].dtype == value.dtype


def test_without_pinned_memory_the_plain_host_tensors_serve(monkeypatch, caplog):
    """Pinned memory can run out (or be absent): a call then copies the stage into plain host
    memory, with a warning, and the values are the same."""
    real_empty = torch.empty
    pins = []

    def no_pinned(*args, pin_memory=False, **kwargs):
        pins.append(pin_memory)
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory (pinned)")
        return real_empty(*args, **kwargs)

    stage = HostStage(_values(), SHAPES)
    monkeypatch.setattr(torch, "empty", no_pinned)
    with caplog.at_level(logging.WARNING, logger=_staging.__name__):
        staged = stage.pinned(torch.device("cuda"))
    assert pins == [True, True, True]  # one block per dtype
    assert "pinned host memory unavailable" in caplog.text
    assert torch.equal(staged["position_ids"][:5], _values()["position_ids"])
    assert not staged["position_ids"][5:].any()
    assert not staged["position_ids"].is_pinned()


def test_each_call_gets_its_own_copy_of_a_stage():
    """Calls never share the blocks they hand to the runtime: a later call's copy is another
    block (on CPU the stage itself serves, and nothing ever writes it)."""
    stage = HostStage(_values(), SHAPES)
    if not torch.cuda.is_available():
        assert stage.pinned(CPU)["weights"] is stage.pinned(CPU)["weights"]
        return
    first, second = stage.pinned(torch.device("cuda")), stage.pinned(torch.device("cuda"))
    assert first["weights"].is_pinned()
    assert first["weights"].data_ptr() != second["weights"].data_ptr()
    assert torch.equal(first["weights"], second["weights"])


def test_static_blocks_take_a_whole_stage_of_their_layout_in_one_copy_per_dtype():
    """``upload(blocks=True)`` makes the static buffers views of one block per dtype (also
    returned under ``block_key``); a stage padded to the same shapes has the same layout, and
    copying its whole blocks fills every view with the stage's padded values."""
    capture = {"a": torch.arange(6, dtype=torch.int32), "b": torch.ones(4, 2, dtype=torch.int64),
               "c": torch.arange(3, dtype=torch.int32)}
    static = upload(capture, torch.device("cpu"), blocks=True)
    blocks = {k for k in static if k.startswith("block:")}
    assert blocks == {_staging.block_key(torch.int32), _staging.block_key(torch.int64)}
    for key in "abc":
        assert torch.equal(static[key], capture[key])
        block = static[_staging.block_key(capture[key].dtype)]
        assert static[key].untyped_storage().data_ptr() == block.untyped_storage().data_ptr()
    shapes = {k: v.shape for k, v in capture.items()}
    replay = {"a": torch.tensor([7, 8], dtype=torch.int32),
              "b": torch.full((1, 2), 5, dtype=torch.int64),
              "c": torch.tensor([9], dtype=torch.int32)}
    stage = HostStage(replay, shapes)
    assert stage.layout == HostStage(capture, shapes).layout
    whole = stage.pinned(torch.device("cpu"), whole=True)
    assert whole.keys() == blocks
    for key, block in whole.items():
        static[key].copy_(block)
    assert static["a"].tolist() == [7, 8, 0, 0, 0, 0] and static["c"].tolist() == [9, 0, 0]
    assert static["b"].tolist() == [[5, 5], [0, 0], [0, 0], [0, 0]]
    # other shapes, another layout: the adapter then loads the views one by one
    assert HostStage(replay, {**shapes, "c": (4,)}).layout != stage.layout
