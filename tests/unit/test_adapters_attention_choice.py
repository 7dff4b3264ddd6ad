"""Dense attention for a budget of one real segment (``key_masked_attention``) and the per-budget
choice of full-attention kernel (``_attention_choice``), on CPU.

What only a GPU can show (the timed choice between flash varlen and dense SDPA, and graphs that
replay the chosen kernel) is in ``tests/gpu/test_packed_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vit_graph_backend.adapters._attention_choice import ATTENTION_SETTINGS, AttentionChoice
from vit_graph_backend.adapters._packed_attention import (
    Segments,
    key_masked_attention,
    packed_attention,
    segment_loop_attention,
)
from vit_graph_backend.errors import InvalidOptionError

CPU = torch.device("cpu")


@settings(max_examples=40, deadline=None)
@given(real=st.integers(1, 40), padding=st.integers(0, 40), heads=st.integers(1, 3),
       dim=st.sampled_from([8, 16, 20, 64, 72, 80]), seed=st.integers(0, 2**16))
def test_key_masked_attention_equals_attention_over_the_real_segment(real, padding, heads, dim,
                                                                      seed):
    """The real rows' outputs are those of attention over the real rows alone, whatever the
    padding holds (here: large values, which a leaking key would show), and every row is finite."""
    gen = torch.Generator().manual_seed(seed)
    rows = real + padding
    q, k, v = (torch.randn(rows, heads, dim, generator=gen, dtype=torch.float64)
               for _ in range(3))
    k[real:] *= 50
    v[real:] += 1000
    offsets = torch.tensor([0, real, rows], dtype=torch.int32)
    scale = dim ** -0.5
    got = key_masked_attention(q, k, v, Segments(offsets, rows), scale)
    expected = segment_loop_attention(q, k, v, [0, real], scale)
    assert got.shape == q.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got[:real], expected, rtol=1e-9, atol=1e-9)


def test_packed_attention_takes_the_dense_path_only_when_marked():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 2, 8, generator=gen) for _ in range(3))
    offsets = torch.tensor([0, 7, 12], dtype=torch.int32)
    plain = packed_attention(q, k, v, Segments(offsets, 12), 8 ** -0.5, None)
    dense = packed_attention(q, k, v, Segments(offsets, 12, dense=True), 8 ** -0.5, None)
    torch.testing.assert_close(dense[:7], plain[:7], rtol=1e-5, atol=1e-6)
    # the masked path attends padding to padding, the dense one padding to the real keys
    assert not torch.allclose(dense[7:], plain[7:])


def test_the_setting_is_checked_when_the_adapter_is_built():
    assert ATTENTION_SETTINGS == ("auto", "varlen", "dense")
    with pytest.raises(InvalidOptionError, match=r"attention='flash' is invalid: must be one of "
                                                 r"auto, varlen, dense"):
        AttentionChoice("flash")


@pytest.mark.parametrize(("setting", "one_segment", "expected"), [
    ("auto", True, "varlen"),     # no CUDA here: nothing to time, segment attention serves
    ("auto", False, "varlen"),
    ("varlen", True, "varlen"),
    ("dense", True, "dense"),
    ("dense", False, "varlen"),   # several segments: dense attention would mix them
])
def test_choice_without_a_gpu(setting, one_segment, expected):
    choice = AttentionChoice(setting)
    got = choice.prepare(96, 2, 8, 8 ** -0.5, one_segment=one_segment, device=CPU,
                         dtype=torch.float32, varlen=None)
    assert got == expected and choice.dense(96) == (expected == "dense")
    assert choice.state["by_rows"] == {96: expected} and choice.state["timings_ms"] == {}
    assert not choice.dense(97)  # a row count no capture prepared


def test_an_inner_compiler_trace_never_sees_a_per_budget_choice(monkeypatch):
    choice = AttentionChoice("dense")
    choice.prepare(96, 2, 8, 8 ** -0.5, one_segment=True, device=CPU, dtype=torch.float32,
                   varlen=None)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not choice.dense(96)
