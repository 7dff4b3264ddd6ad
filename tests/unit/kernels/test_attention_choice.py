"""Dense attention for a budget of one real segment (``key_masked_attention``) and the per-budget
choice of full-attention kernel (``_attention_choice``), on CPU.

What only a GPU can show (the timed choice between flash varlen and dense SDPA, graphs that
replay the chosen kernel, cuDNN's ragged kernel against a reference) is in
``tests/gpu/test_packed*_gpu.py`` and ``tests/gpu/test_cudnn_attention_gpu.py``.
"""

from __future__ import annotations

import importlib
import re
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vit_graph_backend.kernels.attention_choice import (
    ATTENTION_SETTINGS,
    AttentionChoice,
)
from vit_graph_backend.kernels.cudnn_attention import (
    RaggedAttention,
    element_offsets,
    segment_lengths,
)
from vit_graph_backend.kernels.packed_attention import (
    Segments,
    key_masked_attention,
    packed_attention,
    segment_loop_attention,
    varlen_attention,
)
from vit_graph_backend.kernels.short_attention import (
    MAX_HEAD_DIM,
    MAX_ROWS,
    ShortSegmentAttention,
    short_unserved_reason,
)
from vit_graph_backend.errors import InvalidOptionError, MissingDependencyError

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
    assert ATTENTION_SETTINGS == ("auto", "varlen", "dense", "cudnn")
    with pytest.raises(InvalidOptionError, match=r"packed_attention='flash' is invalid: must be None or "
                                                 r"one of auto, varlen, dense, cudnn"):
        AttentionChoice("flash")


@pytest.fixture
def no_cudnn_frontend(monkeypatch):
    """A process where ``import cudnn`` fails, whatever this machine has installed."""
    monkeypatch.setitem(sys.modules, "cudnn", None)


def test_cudnn_without_its_library_is_refused_when_the_adapter_is_built(no_cudnn_frontend):
    with pytest.raises(MissingDependencyError, match=r"packed_attention='cudnn' needs cuDNN's frontend: "
                                                     r".*pip install 'vit-graph-backend\[cudnn\]'"):
        AttentionChoice("cudnn")


@pytest.mark.parametrize("setting", [None, "auto", "dense"])
def test_without_the_library_segment_attention_is_flash_varlen_and_says_why(no_cudnn_frontend,
                                                                              setting):
    choice = AttentionChoice(setting)
    assert choice.ragged is None and choice.state["segments"] == "flash varlen"
    assert "nvidia-cudnn-frontend is not importable" in choice.state["cudnn_off"]


def test_varlen_never_asks_for_cudnn(monkeypatch):
    def fail(name):
        raise AssertionError(f"imported {name}")
    monkeypatch.setattr(importlib, "import_module", fail)
    choice = AttentionChoice("varlen")
    assert choice.ragged is None and choice.state["cudnn_off"] == "packed_attention='varlen'"


def test_segment_attention_runs_flash_varlen_where_cudnn_does_not_serve():
    """cuDNN only serves CUDA tensors: on CPU the call goes to the varlen function, with the
    offsets as both query and key offsets and the static max length twice."""
    choice = AttentionChoice(None)
    if choice.ragged is None:  # no library here: give it the object, which must refuse CPU
        choice.ragged = RaggedAttention()
    q, k, v = (torch.randn(10, 2, 8) for _ in range(3))
    offsets = torch.tensor([0, 4, 10], dtype=torch.int32)
    calls = []

    def varlen(*args):
        calls.append(args)
        return torch.zeros(1)

    out = varlen_attention(q, k, v, Segments(offsets, 10), 8 ** -0.5, varlen,
                           choice.graph_kernel(10))
    assert out.shape == (1,) and len(calls) == 1
    assert calls[0][3] is offsets and calls[0][4] is offsets and calls[0][5:] == (10, 10)
    assert choice.ragged.state == {"plans": 0, "refused": {}}


def test_cudnn_offsets_are_in_elements_and_lengths_per_segment():
    offsets = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    assert element_offsets(offsets, 2 * 4 * 8).flatten().tolist() == [0, 192, 192, 640]
    assert element_offsets(offsets, 1).shape == (4, 1, 1, 1)
    lengths = segment_lengths(offsets)
    assert lengths.flatten().tolist() == [3, 0, 7] and lengths.shape == (3, 1, 1, 1)
    assert lengths.dtype == torch.int32


# ---------------------------------------------------------------- window layers: short segments

def _adapter_layout(rows=70, heads=2, dim=80, dtype=torch.bfloat16):
    """q and k as views of the rotary kernel's ``(rows, 2, heads, dim)`` output, v a view of the
    ``(rows, 3, heads, dim)`` qkv projection: the window layers' layout in the Qwen adapters."""
    qk = torch.zeros(rows, 2, heads, dim, dtype=dtype)
    qkv = torch.zeros(rows, 3, heads, dim, dtype=dtype)
    return qk[:, 0], qk[:, 1], qkv[:, 2]


def test_the_short_segment_kernel_takes_the_adapters_window_layout():
    q, k, v = _adapter_layout()
    offsets = torch.tensor([0, 64, 70], dtype=torch.int32)
    assert short_unserved_reason(q, k, v, offsets, MAX_ROWS) is None
    assert short_unserved_reason(*_adapter_layout(dim=MAX_HEAD_DIM), offsets, 16) is None
    assert short_unserved_reason(*_adapter_layout(dtype=torch.float16), offsets, 1) is None


@pytest.mark.parametrize(("change", "reason"), [
    ("float32", r"dtype torch.float32 \(the short-segment kernel takes float16/bfloat16\)"),
    ("long", r"segments of up to 65 rows \(the kernel takes up to 64\)"),
    ("wide", r"head size 136 \(the kernel takes up to 128\)"),
    ("heads apart", r"k of shape \(70, 2, 80\) and strides \(160, 1, 2\) \(the kernel takes "
                    r"\(70, 2, 80\) with each row's heads contiguous\)"),
    ("shape", r"v of shape \(70, 2, 40\)"),
    ("int64", r"offsets of dtype torch.int64 and shape \(3,\) \(the kernel takes a contiguous "
              r"1-D int32 tensor\)"),
    ("strided", r"offsets of dtype torch.int32 and shape \(3,\)"),
])
def test_the_short_segment_kernel_says_why_it_does_not_serve(change, reason):
    q, k, v = _adapter_layout(dim=136 if change == "wide" else 80,
                              dtype=torch.float32 if change == "float32" else torch.bfloat16)
    if change == "heads apart":
        k = torch.zeros(70, 80, 2, dtype=q.dtype).transpose(1, 2)
    if change == "shape":
        v = v[..., :40]
    offsets = torch.tensor([0, 64, 70], dtype=torch.int64 if change == "int64" else torch.int32)
    if change == "strided":
        offsets = torch.tensor([0, 0, 64, 0, 70, 0], dtype=torch.int32)[::2]
    why = short_unserved_reason(q, k, v, offsets, 65 if change == "long" else 64)
    assert why is not None and re.fullmatch(reason + ".*", why)


def test_the_short_segment_kernel_refuses_cpu_tensors_without_importing_triton():
    short = ShortSegmentAttention()
    q, k, v = _adapter_layout()
    offsets = torch.tensor([0, 64, 70], dtype=torch.int32)
    assert short(q, k, v, offsets, 64, 80 ** -0.5) is None
    assert short._kernel is None and short.state == {"compiled": 0, "refused": {}}


def test_varlen_keeps_flash_varlen_in_window_layers():
    choice = AttentionChoice("varlen")
    assert choice.short is None and choice.short_off == "packed_attention='varlen'"
    choice.prepare(256, 2, 80, 80 ** -0.5, one_segment=False, device=CPU, dtype=torch.bfloat16,
                   varlen=None, windows=(64, 20))
    assert choice.window_by_rows == {256: "varlen"} and choice.window_kernel(256) is None


def test_without_triton_window_layers_run_flash_varlen_and_say_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    choice = AttentionChoice(None)
    assert choice.short is None and "triton is not importable" in choice.short_off
    assert "triton is not importable" in choice.state["windows"]["short_off"]


def test_window_kernel_is_timed_only_on_cuda_and_served_only_where_chosen(monkeypatch):
    choice = AttentionChoice(None)
    if choice.short is None:  # no Triton here: give it the object (it never runs on CPU)
        choice.short = ShortSegmentAttention()
    choice.prepare(256, 2, 80, 80 ** -0.5, one_segment=False, device=CPU, dtype=torch.bfloat16,
                   varlen=lambda *a: None, windows=(64, 20))
    assert choice.window_by_rows == {256: "varlen"} and choice.window_timings == {}
    assert choice.window_kernel(256) is None and choice.window_kernel(512) is None
    choice.window_by_rows[512] = "short"  # as a timing on CUDA would record it
    assert choice.window_kernel(512) is choice.short
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert choice.window_kernel(512) is None  # one trace serves every budget: flash varlen
    state = choice.state["windows"]
    assert state["by_rows"] == {256: "varlen", 512: "short"} and state["timings_ms"] == {}


def test_a_tower_without_windows_chooses_no_window_kernel():
    choice = AttentionChoice(None)
    choice.prepare(256, 2, 80, 80 ** -0.5, one_segment=True, device=CPU, dtype=torch.bfloat16,
                   varlen=None)
    assert choice.window_by_rows == {} and choice.by_rows == {256: "varlen"}


class _FlakyKernel:
    """A kernel (module) whose first ``failures`` runs raise ``error``, then return ``q``."""

    def __init__(self, error: Exception, failures: int = 1) -> None:
        self.error, self.failures, self.runs = error, failures, 0

    def attend(self, q, *args):
        self.runs += 1
        if self.runs <= self.failures:
            raise self.error
        return q


@pytest.fixture
def as_if_on_cuda(monkeypatch):
    """CPU tensors taken for CUDA ones by the kernels' wrappers, outside any capture."""
    import contextlib

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())


@pytest.mark.parametrize(("error", "refused"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"), False),
    (RuntimeError("CUDA error: out of memory"), False),
    (RuntimeError("out of resources: shared memory"), True)])
def test_the_short_kernel_refuses_a_shape_for_a_failure_but_not_for_memory(
        as_if_on_cuda, caplog, error, refused):
    import logging

    short = ShortSegmentAttention()
    short._kernel = _FlakyKernel(error)
    q, k, v = _adapter_layout()
    offsets = torch.tensor([0, 64, 70], dtype=torch.int32)
    with caplog.at_level(logging.WARNING):
        assert short(q, k, v, offsets, 64, 80 ** -0.5) is None   # flash varlen serves this call
    second = short(q, k, v, offsets, 64, 80 ** -0.5)
    assert (second is None) == refused and len(short.state["refused"]) == int(refused)
    assert short._kernel.runs == (1 if refused else 2)   # a refused shape is not tried again
    # a failure by its type and message; memory in one line: what was asked, where it says
    assert (type(error).__name__ if refused else "out of memory (") in caplog.text
    assert "Tried to allocate" not in caplog.text


class _FakeCudnn:
    """Enough of ``cudnn`` for ``RaggedAttention._build``: the handle fails ``failures`` times."""

    def __init__(self, error: Exception, failures: int = 1) -> None:
        self.error, self.failures, self.handles = error, failures, 0

    def create_handle(self):
        self.handles += 1
        if self.handles <= self.failures:
            raise self.error
        raise RuntimeError("no plan in this fake")   # got past the handle: a real refusal


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory"),
    RuntimeError("cudnnCreate failed: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"),
    RuntimeError("CUDNN_STATUS_ALLOC_FAILED")])
def test_cudnn_out_of_memory_while_building_is_tried_again(as_if_on_cuda, caplog, error):
    import logging

    ragged = RaggedAttention()
    ragged._cudnn = _FakeCudnn(error)
    q, k, v = (torch.randn(70, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    offsets = torch.tensor([0, 64, 70], dtype=torch.int32)
    with caplog.at_level(logging.WARNING):
        assert ragged(q, k, v, offsets, 64, 0.25) is None
    assert ragged.state == {"plans": 0, "refused": {}} and "out of memory (" in caplog.text
    assert ragged(q, k, v, offsets, 64, 0.25) is None   # tried again: now a real refusal
    assert ragged._cudnn.handles == 2
    assert list(ragged.state["refused"].values()) == ["RuntimeError: no plan in this fake"]
    assert ragged(q, k, v, offsets, 64, 0.25) is None and ragged._cudnn.handles == 2


def test_cudnn_launches_on_the_stream_of_the_tensors_device(monkeypatch):
    """The handle was made on the tensors' device: its launch takes that device's current stream
    with that device current, not the current device's (another GPU's stream fails the launch,
    as a two-GPU run of the GPU suite showed)."""
    import contextlib
    from types import SimpleNamespace

    entered, asked, launches = [], [], []

    @contextlib.contextmanager
    def device(d):
        entered.append(d)
        yield

    def current_stream(d=None):
        asked.append(d)
        return SimpleNamespace(cuda_stream=f"stream of {d}")

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    ragged = RaggedAttention()
    graph = SimpleNamespace(execute=lambda feeds, workspace, handle: launches.append(
        (entered[-1] if entered else None, handle)))
    plan = SimpleNamespace(inputs=("q", "k", "v"), out="o", seq="s", offsets={}, workspace=0,
                           graph=graph)
    monkeypatch.setattr(ragged, "_build", lambda *args: plan)
    streams = []
    ragged._cudnn = SimpleNamespace(set_stream=lambda handle, stream: streams.append(stream))
    q, k, v = (torch.randn(70, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    ragged._handles[q.device.index] = "handle of q's device"
    out = ragged(q, k, v, torch.tensor([0, 64, 70], dtype=torch.int32), 64, 0.25)
    assert out is not None and out.shape == q.shape
    assert asked == [q.device] and streams == [f"stream of {q.device}"]
    assert launches == [(q.device, "handle of q's device")]
