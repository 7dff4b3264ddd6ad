"""Host staging of packed metadata (``adapters/_staging.py``), on CPU.

What the GPU adds (pinned blocks, device records, copies that do not wait for a busy GPU,
results still right) is checked in ``tests/gpu/test_packed_gpu.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vit_graph_backend.adapters import staging as _staging
from vit_graph_backend.adapters.staging import BLOCK, HostStage, layout_of, upload
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


_DTYPES = (torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.uint8)


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4), st.sampled_from(_DTYPES)),
                min_size=1, max_size=5))
@settings(max_examples=60, deadline=None)
def test_padding_never_mixes_the_buffers_of_a_block(sizes):
    """Every buffer of a stage shares one block of bytes, whatever its dtype: each keeps its
    own values and zeros at any lengths (a wrong offset would show up in a neighbour), and each
    view starts 16-byte aligned."""
    values, shapes = {}, {}
    for i, (rows, extra, dtype) in enumerate(sizes):
        values[f"b{i}"] = (torch.arange(rows * 3).reshape(rows, 3) % 50 + 2 * i + 1).to(dtype)
        shapes[f"b{i}"] = (rows + extra, 3)
    stage = HostStage(values, shapes)
    staged = stage.pinned(CPU)
    block = stage.pinned(CPU, whole=True)[BLOCK]
    assert block.dtype == torch.uint8 and block.numel() == stage.nbytes
    for key, value in values.items():
        expected = torch.zeros(shapes[key], dtype=value.dtype)
        expected[:value.shape[0]] = value
        assert torch.equal(staged[key], expected) and staged[key].dtype == value.dtype, key
        assert staged[key].untyped_storage().data_ptr() == block.untyped_storage().data_ptr()
        offset = staged[key].storage_offset() * staged[key].element_size()
        assert offset % 16 == 0, (key, offset)
    # the block holds each buffer whole, back to back within its alignment
    assert stage.nbytes == sum(-(-torch.Size(shapes[k]).numel() * v.element_size() // 16) * 16
                               for k, v in values.items())


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
    assert pins == [True]  # one block for every dtype
    assert "pinned host memory unavailable" in caplog.text
    assert torch.equal(staged["position_ids"][:5], _values()["position_ids"])
    assert not staged["position_ids"][5:].any()
    assert not staged["position_ids"].is_pinned()


def test_each_call_gets_its_own_copy_of_a_stage():
    """Calls never share the blocks they hand to the runtime: a later call's copy is another
    block (on CPU the stage itself serves, and nothing ever writes it)."""
    stage = HostStage(_values(), SHAPES)
    if not torch.cuda.is_available():
        assert stage.pinned(CPU)["weights"].data_ptr() == stage.pinned(CPU)["weights"].data_ptr()
        return
    first, second = stage.pinned(torch.device("cuda")), stage.pinned(torch.device("cuda"))
    assert first["weights"].is_pinned()
    assert first["weights"].data_ptr() != second["weights"].data_ptr()
    assert torch.equal(first["weights"], second["weights"])


def test_static_buffers_take_a_whole_stage_of_their_layout_in_one_copy():
    """``upload(blocks=True)`` makes the static buffers views of one block of bytes (also
    returned under ``BLOCK``), whatever their dtypes; a stage padded to the same shapes has the
    same layout, and copying its whole block fills every view with the stage's padded values."""
    capture = {"a": torch.arange(6, dtype=torch.int32), "b": torch.ones(4, 2, dtype=torch.int64),
               "c": torch.arange(3, dtype=torch.int32), "d": torch.ones(3, dtype=torch.float32)}
    static = upload(capture, torch.device("cpu"), blocks=True)
    assert static.keys() == set(capture) | {BLOCK}
    for key in capture:
        assert torch.equal(static[key], capture[key]) and static[key].dtype == capture[key].dtype
        assert (static[key].untyped_storage().data_ptr()
                == static[BLOCK].untyped_storage().data_ptr())
    shapes = {k: v.shape for k, v in capture.items()}
    replay = {"a": torch.tensor([7, 8], dtype=torch.int32),
              "b": torch.full((1, 2), 5, dtype=torch.int64),
              "c": torch.tensor([9], dtype=torch.int32), "d": torch.tensor([0.25, 0.5])}
    stage = HostStage(replay, shapes)
    assert stage.layout == HostStage(capture, shapes).layout
    whole = stage.pinned(torch.device("cpu"), whole=True)
    assert whole.keys() == {BLOCK}
    static[BLOCK].copy_(whole[BLOCK])
    assert static["a"].tolist() == [7, 8, 0, 0, 0, 0] and static["c"].tolist() == [9, 0, 0]
    assert static["b"].tolist() == [[5, 5], [0, 0], [0, 0], [0, 0]]
    assert static["d"].tolist() == [0.25, 0.5, 0.0]
    # other shapes, another layout: the adapter then loads the views one by one
    assert HostStage(replay, {**shapes, "c": (4,)}).layout != stage.layout
    # views of a copy of the block are the stage's buffers again
    again = stage.views(whole[BLOCK].clone())
    assert all(torch.equal(again[k], stage.views()[k]) for k in capture)


def test_a_layout_names_each_buffer_dtype_shape_and_offset():
    layout, nbytes = layout_of({"x": torch.zeros(3, dtype=torch.int64),
                                "y": torch.zeros(1, 2, dtype=torch.bfloat16)},
                               {"x": (5,), "y": (3, 2)})
    assert layout == (("x", torch.int64, (5,), 0), ("y", torch.bfloat16, (3, 2), 48))
    assert nbytes == 48 + 16  # 40 bytes of x rounded up to 48; 12 of y to 16


def test_host_copies_in_pieces_are_exact(monkeypatch):
    """The pinned copy goes in pieces of 8-byte words small enough for one thread: a block of
    several pieces, and one not a whole number of them, arrives byte for byte, and so does a
    stage's block."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    monkeypatch.setattr(_staging, "_ONE_THREAD", 5)
    for words in (0, 3, 5, 12):
        block = torch.randint(0, 256, (8 * words,), dtype=torch.uint8)
        copy = _staging._pinned_copy(block)
        assert torch.equal(copy, block) and (not words or copy.data_ptr() != block.data_ptr())
    # through the stage's own block, several pieces long
    values = {"a": torch.arange(70, dtype=torch.int64), "b": torch.ones(9, dtype=torch.int32),
              "c": torch.arange(21, dtype=torch.int64).reshape(7, 3) + 1}
    shapes = {"a": (80,), "b": (10,), "c": (9, 3)}
    staged = HostStage(values, shapes).pinned(torch.device("cuda"))
    for key, value in values.items():
        n = value.shape[0]
        assert torch.equal(staged[key][:n], value) and not staged[key][n:].any(), key
