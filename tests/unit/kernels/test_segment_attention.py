"""The Triton segment kernel's wrapper (``adapters/_segment_attention.py``) and its per-budget
choice against cuDNN (``_attention_choice``), on CPU: what it refuses and why, compiling once,
the fallback chain, and the choice from timings.

The kernel itself against a reference, inside captured graphs and in served towers is in
``tests/gpu/test_segment_attention_gpu.py``.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

from vit_graph_backend.kernels import attention_choice as _attention_choice
from vit_graph_backend.kernels import segment_attention as _segment_attention
from vit_graph_backend.kernels.attention_choice import AttentionChoice
from vit_graph_backend.kernels.segment_attention import (
    MAX_HEAD_DIM,
    MAX_SEGMENTS,
    SegmentFlashAttention,
    segment_unserved_reason,
)

CPU = torch.device("cpu")


def _layout(rows=70, heads=2, dim=80, dtype=torch.bfloat16):
    """q and k as views of one rotated buffer and v of the projection, as the towers lay them."""
    qk = torch.randn(rows, 2, heads, dim).to(dtype)
    qkv = torch.randn(rows, 3, heads, dim).to(dtype)
    return qk[:, 0], qk[:, 1], qkv[:, 2]


OFFSETS = torch.tensor([0, 40, 40, 70], dtype=torch.int32)


def test_the_towers_layout_is_served():
    assert segment_unserved_reason(*_layout(), OFFSETS) is None
    assert segment_unserved_reason(*_layout(dim=72, dtype=torch.float16), OFFSETS) is None
    assert segment_unserved_reason(*_layout(dim=MAX_HEAD_DIM), OFFSETS) is None


@pytest.mark.parametrize(("change", "expected"), [
    ("offsets", "offsets of dtype torch.int64"),
    ("dtype", "dtype torch.float32"),
    ("odd head", "head size 84"),
    ("wide head", "head size 264"),
    ("heads apart", "with each row's heads contiguous"),
    ("unaligned", "16-byte aligned"),
])
def test_each_layout_it_cannot_take_is_refused_with_the_value(change, expected):
    offsets = OFFSETS.long() if change == "offsets" else OFFSETS
    if change == "dtype":
        q, k, v = _layout(dtype=torch.float32)
    elif change in ("odd head", "wide head"):
        q, k, v = _layout(dim=84 if change == "odd head" else 264)
    elif change == "heads apart":
        q, k, v = _layout()
        q = torch.randn(70, 80, 2, dtype=torch.bfloat16).transpose(1, 2)
    else:  # one element in: rows no longer start on 16 bytes
        q, k, v = _layout()
        q = torch.randn(70 * 160 + 1, dtype=torch.bfloat16)[1:].view(70, 2, 80)
    why = segment_unserved_reason(q, k, v, offsets)
    assert why is not None and expected in why


def test_a_gpu_without_tma_is_refused(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(_segment_attention, "_capability", lambda index: (8, 0))
    why = segment_unserved_reason(*_layout(), OFFSETS)
    assert why is not None and "compute capability 8.0" in why


def test_cpu_tensors_are_refused_without_importing_triton():
    kernel = SegmentFlashAttention()
    assert kernel(*_layout(), OFFSETS, 70, 80 ** -0.5) is None
    assert kernel._kernel is None and kernel.state == {"compiled": 0, "refused": {}}


class _FakeKernel:
    """The kernel module: counts the launches, or raises ``error``."""

    def __init__(self, error: Exception | None = None) -> None:
        self.launches, self.error = 0, error

    def attend(self, q, k, v, offsets, scale):
        if self.error is not None:
            raise self.error
        self.launches += 1
        return torch.zeros_like(q)


@pytest.fixture
def as_if_on_cuda(monkeypatch):
    """CPU tensors taken for CUDA ones on a GPU with TMA, outside any capture."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(_segment_attention, "_capability", lambda index: (9, 0))


def test_a_served_shape_is_compiled_once_and_then_launched(as_if_on_cuda):
    kernel = SegmentFlashAttention()
    kernel._kernel = fake = _FakeKernel()
    for _ in range(4):  # four full-attention layers
        assert kernel(*_layout(), OFFSETS, 70, 80 ** -0.5) is not None
    assert fake.launches == 4 and kernel.state == {"compiled": 1, "refused": {}}


def test_too_many_segment_slots_are_refused():
    offsets = torch.zeros(MAX_SEGMENTS + 2, dtype=torch.int32)
    offsets[-1] = 70
    why = segment_unserved_reason(*_layout(), offsets)
    assert why is not None and f"{MAX_SEGMENTS + 1} segment slots" in why


@pytest.mark.parametrize(("error", "refused"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"), False),
    (RuntimeError("CUDA error: out of memory"), False),
    (RuntimeError("illegal memory access"), True)])
def test_a_failure_refuses_the_shape_but_memory_does_not(as_if_on_cuda, error, refused):
    kernel = SegmentFlashAttention()
    kernel._kernel = _FakeKernel(error)
    assert kernel(*_layout(), OFFSETS, 70, 80 ** -0.5) is None
    assert len(kernel.state["refused"]) == int(refused)


def test_settings_that_fix_a_kernel_never_run_it():
    for setting in ("varlen", "cudnn"):
        try:
            choice = AttentionChoice(setting)
        except Exception:  # "cudnn" without the library: nothing to run it beside
            continue
        assert choice.segment is None and choice.segment_off == f"packed_attention={setting!r}"
        assert choice.state["full"]["triton_off"] == f"packed_attention={setting!r}"


def test_without_triton_full_attention_keeps_its_kernel_and_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    choice = AttentionChoice(None)
    assert choice.segment is None and "triton is not importable" in choice.segment_off


class _Kernel:
    def __init__(self, out):
        self.out, self.calls = out, 0

    def __call__(self, *args):
        self.calls += 1
        return self.out


def test_the_chosen_budget_tries_triton_then_cudnn_then_flash_varlen(monkeypatch):
    choice = AttentionChoice(None)
    choice.full_by_rows = {256: "triton", 512: "varlen"}
    served, refused = torch.ones(1), None
    cudnn = _Kernel(torch.zeros(1))
    choice.ragged, choice.segment = cudnn, _Kernel(served)
    assert choice.graph_kernel(512) is cudnn
    assert choice.graph_kernel(256)(1, 2, 3) is served and cudnn.calls == 0
    choice.segment = _Kernel(refused)  # the kernel does not serve this call
    assert choice.graph_kernel(256)(1, 2, 3) is cudnn.out and cudnn.calls == 1
    choice.ragged = None  # no cuDNN either: the caller runs flash varlen
    assert choice.graph_kernel(256)(1, 2, 3) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert choice.graph_kernel(256) is None


def test_the_layouts_are_the_graphs_segments():
    """One image of all the rows and one of two thirds, then the graph's empty frame slots and
    the padding segment; with several frame slots also two images of a third each."""
    assert _attention_choice.full_layouts(300, 1) == [[0, 300, 300], [0, 200, 300]]
    assert _attention_choice.full_layouts(300, 3) == [[0, 300, 300, 300, 300],
                                                       [0, 200, 200, 200, 300],
                                                       [0, 100, 200, 200, 300]]
    assert _attention_choice.full_layouts(301, 2) == [[0, 301, 301, 301], [0, 200, 200, 301],
                                                       [0, 100, 200, 301]]


@pytest.mark.parametrize(("frames", "triton_ms", "expected"), [
    (1, 0.8, "triton"), (1, 1.2, "varlen"), (3, 0.9, "triton"), (3, 1.1, "varlen"),
    (3, None, "varlen")])
def test_the_kernel_is_chosen_from_the_summed_timings(monkeypatch, frames, triton_ms, expected):
    timed = []

    def race(rows, what, kernels, compared, timings):
        timed.append(sorted(kernels))
        return None if triton_ms is None else {"varlen": 1.0, "triton": triton_ms}

    choice = AttentionChoice(None)
    choice.segment = _Kernel(None)
    monkeypatch.setattr(_attention_choice, "_race", race)
    monkeypatch.setattr(_attention_choice, "_timed_on", lambda device: True)
    got = choice._choose_segment_kernel(300, 2, 80, 80 ** -0.5, frames, CPU, torch.bfloat16,
                                        varlen=lambda *a: None)
    assert got == expected
    layouts = 1 if triton_ms is None else (2 if frames == 1 else 3)  # a disagreement ends it
    assert timed == [["triton", "varlen"]] * layouts
    if triton_ms is not None:
        assert choice.full_timings[300] == {"varlen": 1.0 * layouts,
                                            "triton": round(triton_ms * layouts, 4)}


def test_on_cpu_no_kernel_is_timed():
    choice = AttentionChoice(None)
    choice.segment = _Kernel(None)
    choice.prepare(256, 2, 80, 80 ** -0.5, one_segment=True, device=CPU, dtype=torch.bfloat16,
                   varlen=lambda *a: None, frames=2)
    assert choice.full_by_rows == {256: "varlen"} and choice.segment.calls == 0
    assert choice.graph_kernel(256) is choice.ragged
