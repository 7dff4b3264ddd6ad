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
from vit_graph_backend.adapters._staging import pinned_padded, upload
from vit_graph_backend.errors import UnsupportedGraphError

CPU = torch.device("cpu")


def _values() -> dict[str, torch.Tensor]:
    return {"position_ids": torch.arange(10, dtype=torch.int64).reshape(5, 2) + 1,
            "frame_seqlens": torch.tensor([3, 2], dtype=torch.int32),
            "weights": torch.full((5, 4), 0.5)}


SHAPES = {"position_ids": (8, 2), "frame_seqlens": (4,), "weights": (7, 4)}


def test_pinned_padded_pads_each_buffer_with_zeros_to_its_shape():
    staged = pinned_padded(_values(), SHAPES, CPU)
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
    staged = pinned_padded(values, shapes, CPU)
    for key, value in values.items():
        expected = torch.zeros(shapes[key], dtype=torch.int64)
        expected[:value.shape[0]] = value
        assert torch.equal(staged[key], expected), key


def test_a_longer_buffer_or_other_width_is_refused_with_its_shapes():
    with pytest.raises(UnsupportedGraphError, match=r"'frame_seqlens' of shape \(2,\).*\(1,\)"):
        pinned_padded(_values(), {**SHAPES, "frame_seqlens": (1,)}, CPU)
    with pytest.raises(UnsupportedGraphError, match=r"'weights' of shape \(5, 4\).*\(7, 3\)"):
        pinned_padded(_values(), {**SHAPES, "weights": (7, 3)}, CPU)


def test_upload_keeps_values_shapes_and_dtypes():
    out = upload(_values(), CPU)
    for key, value in _values().items():
        assert torch.equal(out[key], value) and out[key].dtype == value.dtype


def test_without_pinned_memory_the_plain_host_tensors_serve(monkeypatch, caplog):
    """Pinned memory can run out (or be absent): staging then uses plain host memory, with
    one warning, and the values are the same."""
    real = _staging._blocks
    pins = []

    def no_pinned(values, shapes, pin):
        pins.append(pin)
        if pin:
            raise RuntimeError("CUDA error: out of memory (pinned)")
        return real(values, shapes, pin)

    monkeypatch.setattr(_staging, "_blocks", no_pinned)
    with caplog.at_level(logging.WARNING, logger=_staging.__name__):
        staged = pinned_padded(_values(), SHAPES, torch.device("cuda"))
    assert pins == [True, False]
    assert "pinned host memory unavailable" in caplog.text
    assert torch.equal(staged["position_ids"][:5], _values()["position_ids"])
    assert not staged["position_ids"].is_pinned()
