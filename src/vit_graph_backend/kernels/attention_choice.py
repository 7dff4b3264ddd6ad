"""Which full-attention kernel each budget's graph runs, chosen by measuring at capture time.

A packed graph attends within segments given as offsets, so it runs flash varlen attention
(``_packed_attention``). When a budget's batches can hold only one real segment (one slot of one
frame: ``max_items_per_graph=1`` or ``max_frames_per_batch=1``, single images), full attention
is one segment followed by the padding rows, and a dense SDPA call can serve it: PyTorch then
picks its own fastest kernel (cuDNN on an H100), which over 16,384 rows at head size 80 ran
1.6x faster than flash varlen (``benchmarks/results/varlen_attention_probe_*``). Dense
attention has no segments, so
:func:`~vit_graph_backend.kernels.packed_attention.key_masked_attention` hides the padding
keys through one extra head channel instead of a mask (a mask would cost SDPA that speed); in
the graphs the channel is added by the rotary embedding's fused kernel
(``_fused.rotate_qk_wide``), so both kernels are timed without the work around them.

Neither kernel wins everywhere: dense attention also computes the padding rows' scores, and a
budget's padding varies per call. So for each budget :meth:`AttentionChoice.prepare` times both
on the budget's own shapes with random data laid out as a call near the bottom of the budget's
range would be (one real segment of two thirds of the rows, the rest padding: a budget serves
items larger than the next smaller budget, at most 1.5x smaller with the default ladder), checks
that they agree, and keeps the faster one. Dense attention is thus kept only where it wins for
the budget's worst typical padding; a stream measured with the choice made at an eighth of
padding instead put its largest images (40 % padding) in dense budgets, and its p99 rose from
47.6 to 56.5 ms (``benchmarks/results/attention_choice_*``). ``packed_attention="dense"`` suits budgets
that fit the images exactly (a fixed image size with ``budgets=`` its token count);
``"varlen"`` fixes flash varlen. Window attention (Qwen2.5-VL) always has many segments: its
kernel is chosen apart (below).

Full attention over segments (every budget) runs cuDNN's ragged kernel in the graphs where
``nvidia-cudnn-frontend`` is installed (``_cudnn_attention``: 1.5 to 2x flash varlen's speed in
the Qwen2.5-VL-3B tower's full layers; in its window layers cuDNN is slower than flash varlen),
flash varlen otherwise: the default
(``packed_attention=None``) takes cuDNN when the library imports, ``"cudnn"`` insists on it (an error
when the adapter is built without it), ``"varlen"`` keeps flash varlen, and ``"auto"`` and
``"dense"`` compare dense attention with whichever segment kernel serves.

Where Triton imports and the GPU has TMA, full attention over segments has a third kernel: the
Triton segment kernel (``_segment_attention``), which tiles heads of 80 and 72 as 64 + 16 columns
where cuDNN runs them 128 wide. It was 5 % slower than cuDNN to 19 % faster on the
Qwen2.5-VL-3B tower's layouts, 8 % slower to 7 % faster on the Qwen3-VL-8B tower's
(``benchmarks/results/segment_attention_kernel_*``), so for each budget
:meth:`AttentionChoice.prepare` times it against the segment kernel that serves otherwise
(cuDNN, else flash varlen) on the budget's full-attention layouts (one image of all the rows and
one of two thirds, each with the graph's empty slots and padding segment; a budget of several
frames also two images of a third each; the times summed), checks that they agree, and keeps
the faster (``full_by_rows``); ``packed_attention="varlen"`` and ``"cudnn"`` never run it.

Window layers (Qwen2.5-VL: segments of at most 64 rows) have two kernels of the same inputs and
outputs: flash varlen and the short-segment Triton kernel (``_short_attention``, about twice as
fast at the 3B tower's shapes on an H100). For each budget of a tower with windows,
:meth:`AttentionChoice.prepare` times both on the budget's window layout (full windows, the
graph's empty slots and padding chunks), checks that they agree, and keeps the faster
(``window_by_rows``); ``packed_attention="varlen"`` keeps flash varlen there too, and so does a process
without Triton.

Every choice is timed from CUDA-graph replays (``gpu_timing.graph_ms``). Timed as single
launches, a small budget's kernels measured the host's launch time (0.05 to 0.16 ms against 0.01
to 0.02 ms of GPU time on an H100), and ``"auto"`` chose dense attention for the small budgets of
the Qwen2.5-VL-3B ladder where it did not pay: that single-image stream ran 8 % slower
(``attention_choice_single_image_streams_margin_*``). Timed from graphs, ``"auto"`` keeps dense
attention for the smallest budgets only and its streams run even with the default (p50 6.98
against 7.08 ms for the 3B tower, p99 35.1 against 36.2 ms for a Qwen3-VL-8B-shaped one,
``attention_choice_graph_timed_single_image_streams_default_vs_auto_*``), while its first pass
also compiles the widened rotary kernel: no gain that would make it the default.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch

from ..errors import InvalidOptionError, MissingDependencyError, error_line
from ..runtime.timing import graph_ms
from .cudnn_attention import RaggedAttention, cudnn_frontend_reason
from .packed_attention import Segments, dense_sdpa, varlen_attention, widen_for_dense
from .segment_attention import SegmentFlashAttention
from .short_attention import ShortSegmentAttention, triton_reason

__all__ = ["ATTENTION_SETTINGS", "AttentionChoice"]

log = logging.getLogger(__name__)

#: ``attention`` values besides ``None`` (the default: cuDNN segment attention where its library
#: imports, else flash varlen): measure per budget, or always one kernel where it applies.
ATTENTION_SETTINGS = ("auto", "varlen", "dense", "cudnn")

#: Dense attention is kept only when timed at least this much faster: its graph also widens q,
#: k and v inside the rotary kernel, which the timing leaves out (0.08 ms a layer at 6,724 rows
#: on an H100, a tenth of the attention there; ``packed_large_image_kernel_time_by_kind_*``).
_DENSE_MARGIN = 0.9

#: Largest max-abs difference between the kernels on unit-variance bf16 inputs that counts as
#: agreeing (both measured within 1e-2 of a float32 reference; a wrong kernel is off by ~1).
_AGREE = 5e-2


class AttentionChoice:
    """The ``attention`` setting of one adapter and the kernel chosen for each budget.

    Args:
        setting: ``None`` (default: segment attention through cuDNN in the graphs where
            ``nvidia-cudnn-frontend`` imports, else flash varlen), ``"cudnn"`` (the same, and an
            error without the library), ``"varlen"`` (flash varlen always), ``"auto"`` (measure
            dense against segment attention per one-segment budget at capture, on CUDA) or
            ``"dense"`` (dense SDPA wherever a budget holds one real segment, on any device).
            Window layers: every setting but ``"varlen"`` times the short-segment kernel
            against flash varlen per budget on CUDA (module docstring); ``"varlen"`` keeps
            flash varlen.

    Raises:
        InvalidOptionError: for another value.
        MissingDependencyError: ``"cudnn"`` without an importable ``nvidia-cudnn-frontend``.
    """

    def __init__(self, setting: str | None = None) -> None:
        if setting is not None and setting not in ATTENTION_SETTINGS:
            raise InvalidOptionError(
                f"packed_attention={setting!r} is invalid: must be None or one of "
                f"{', '.join(ATTENTION_SETTINGS)} ('auto' times segment attention against dense "
                "SDPA per budget at capture)")
        self.setting = setting
        #: why cuDNN segment attention is off (``None``: on), for reports
        self.cudnn_off = "packed_attention='varlen'" if setting == "varlen" else cudnn_frontend_reason()
        if setting == "cudnn" and self.cudnn_off is not None:
            raise MissingDependencyError(f"packed_attention='cudnn' needs cuDNN's frontend: "
                                         f"{self.cudnn_off}")
        #: cuDNN segment attention for the graphs, or ``None`` (flash varlen serves)
        self.ragged = RaggedAttention() if self.cudnn_off is None else None
        #: static row count of a captured budget -> "dense" or "varlen" (segment attention)
        self.by_rows: dict[int, str] = {}
        #: static row count -> measured ms per kernel (``auto`` only), for reports
        self.timings: dict[int, dict[str, float]] = {}
        #: why window layers never run the short-segment kernel (``None``: measured per budget)
        self.short_off = "packed_attention='varlen'" if setting == "varlen" else triton_reason()
        #: the short-segment kernel for window layers, or ``None`` (flash varlen serves)
        self.short = ShortSegmentAttention() if self.short_off is None else None
        #: static row count -> window layers' kernel ("short" or "varlen")
        self.window_by_rows: dict[int, str] = {}
        #: static row count -> the window kernels' measured ms, for reports
        self.window_timings: dict[int, dict[str, float]] = {}
        #: why full attention never runs the Triton segment kernel (``None``: measured per
        #: budget on CUDA)
        self.segment_off = (f"packed_attention={setting!r}" if setting in ("varlen", "cudnn")
                            else triton_reason())
        #: the Triton segment kernel for full attention, or ``None``
        self.segment = SegmentFlashAttention() if self.segment_off is None else None
        #: static row count -> full attention's segment kernel ("triton" or "varlen": cuDNN
        #: where it serves, else flash varlen)
        self.full_by_rows: dict[int, str] = {}
        #: static row count -> the full segment kernels' measured ms, for reports
        self.full_timings: dict[int, dict[str, float]] = {}

    def prepare(self, rows: int, heads: int, head_dim: int, scale: float, *, one_segment: bool,
                device: torch.device, dtype: torch.dtype,
                varlen: Callable[..., Any] | None,
                windows: tuple[int, int] | None = None, frames: int = 1) -> str:
        """Choose the full-attention kernel of the budget whose static buffers have ``rows``
        rows (called before its capture); returns ``"dense"`` or ``"varlen"``. ``windows``:
        ``(rows of a full window, window segment slots)`` of a tower with window layers, whose
        kernel is then chosen too (:meth:`window_kernel`); ``frames``: the graph's segment slots
        for full attention besides the padding segment (the segment kernel is chosen on that
        layout: :meth:`graph_kernel`)."""
        if not self.by_rows and device.type == "cuda" and self.ragged is None and (
                self.setting != "varlen"):  # once, at the first capture: where graphs exist
            log.info("vitgraph: full attention in graphs runs flash varlen: %s", self.cudnn_off)
        self.full_by_rows[rows] = self._choose_segment_kernel(
            rows, heads, head_dim, scale, frames, device, dtype, varlen)
        if windows is not None:
            self.window_by_rows[rows] = self._choose_window_kernel(
                rows, heads, head_dim, scale, windows, device, dtype, varlen)
        choice = "varlen"
        if one_segment and self.setting == "dense":  # any device: the CPU tests run it too
            choice = "dense"
        elif one_segment and self.setting == "auto" and varlen is not None and _timed_on(device):
            choice = self._measure(rows, heads, head_dim, scale, device, dtype, varlen)
        self.by_rows[rows] = choice
        return choice

    def graph_kernel(self, rows: int) -> Callable[..., torch.Tensor | None] | None:
        """The segment kernel of a graph's full attention in the budget of ``rows`` static
        rows: the Triton segment kernel where it was timed faster (cuDNN, then flash varlen,
        where it does not serve a call), else cuDNN's ragged attention, or ``None`` (flash
        varlen). Never while an inner compiler traces (these calls are opaque to it)."""
        if torch.compiler.is_compiling():
            return None
        if self.full_by_rows.get(rows) == "triton":
            return _FirstServing(self.segment, self.ragged)
        return self.ragged

    def window_kernel(self, rows: int) -> ShortSegmentAttention | None:
        """The short-segment kernel where it was chosen for the budget of ``rows`` static rows,
        else ``None`` (flash varlen). Never while an inner compiler traces (one trace serves
        every budget, and the kernel's call is opaque to it)."""
        if torch.compiler.is_compiling() or self.window_by_rows.get(rows) != "short":
            return None
        return self.short

    def dense(self, rows: int) -> bool:
        """True if the budget of ``rows`` static rows runs dense attention. Never while an inner
        compiler traces: it traces once for every budget (symbolic rows), and a choice per row
        count would specialize it."""
        return not torch.compiler.is_compiling() and self.by_rows.get(rows) == "dense"

    @property
    def state(self) -> dict[str, Any]:
        """The setting, each captured budget's kernel by its static row count, and the timings."""
        return {"attention": self.setting,
                "segments": "flash varlen" if self.ragged is None else "cudnn",
                "cudnn_off": self.cudnn_off,
                "cudnn": self.ragged.state if self.ragged is not None else None,
                "by_rows": dict(sorted(self.by_rows.items())),
                "timings_ms": dict(sorted(self.timings.items())),
                "full": {"triton_off": self.segment_off,
                         "triton": self.segment.state if self.segment is not None else None,
                         "by_rows": dict(sorted(self.full_by_rows.items())),
                         "timings_ms": dict(sorted(self.full_timings.items()))},
                "windows": {"short_off": self.short_off,
                            "short": self.short.state if self.short is not None else None,
                            "by_rows": dict(sorted(self.window_by_rows.items())),
                            "timings_ms": dict(sorted(self.window_timings.items()))}}

    def _choose_window_kernel(self, rows: int, heads: int, head_dim: int, scale: float,
                              windows: tuple[int, int], device: torch.device,
                              dtype: torch.dtype, varlen: Callable[..., Any] | None) -> str:
        """Time the short-segment kernel against flash varlen on the budget's window layout
        (full windows over every row, then the slots left empty and the padding chunks the
        graph adds: ``_qwen_packing.QwenPacker.segments``), each replayed from a CUDA graph."""
        window, slots = windows
        if self.short is None or varlen is None or not _timed_on(device) or window < 1:
            return "varlen"
        full, rest = divmod(rows, window)
        lengths = [window] * full + ([rest] if rest else [])
        count = slots + rows // window + 2  # the graph's slot count (at least)
        lengths += [0] * max(0, count - len(lengths))
        offsets = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        offsets = offsets.to(device)
        q, k, v = _random_qkv(rows, heads, head_dim, device, dtype)
        short = self.short
        ms = _race(rows, "window attention", {
            "varlen": lambda: varlen(q, k, v, offsets, offsets, window, window),
            "short": lambda: short(q, k, v, offsets, window, scale)}, rows, self.window_timings)
        if ms is None:
            return "varlen"
        choice = "short" if ms["short"] < ms["varlen"] else "varlen"
        log.info("vitgraph: %d rows, window attention: %s (flash varlen %.3f ms, short-segment "
                 "kernel %.3f ms)", rows, choice, ms["varlen"], ms["short"])
        return choice

    def _choose_segment_kernel(self, rows: int, heads: int, head_dim: int, scale: float,
                               frames: int, device: torch.device, dtype: torch.dtype,
                               varlen: Callable[..., Any] | None) -> str:
        """Time the Triton segment kernel against the one that serves otherwise (cuDNN, else
        flash varlen) on the budget's full-attention layout, each replayed from a CUDA graph
        (module docstring); ``"triton"`` where it was faster."""
        if self.segment is None or varlen is None or not _timed_on(device):
            return "varlen"
        q, k, v = _random_qkv(rows, heads, head_dim, device, dtype)
        segment = self.segment
        total: dict[str, float] = {}
        for layout in full_layouts(rows, frames):
            segments = Segments(torch.tensor(layout, dtype=torch.int32, device=device), rows)
            ms = _race(rows, "full attention", {
                "varlen": lambda: varlen_attention(q, k, v, segments, scale, varlen,
                                                   self.ragged),
                "triton": lambda: segment(q, k, v, segments.offsets, rows, scale)},
                rows, {})
            if ms is None:
                return "varlen"
            for name, value in ms.items():
                total[name] = total.get(name, 0.0) + value
        self.full_timings[rows] = {key: round(value, 4) for key, value in total.items()}
        choice = "triton" if total["triton"] < total["varlen"] else "varlen"
        log.info("vitgraph: %d rows, full attention over segments: %s (%s %.3f ms, Triton "
                 "segment kernel %.3f ms)", rows, choice,
                 "cuDNN" if self.ragged is not None else "flash varlen", total["varlen"],
                 total["triton"])
        return choice

    def _measure(self, rows: int, heads: int, head_dim: int, scale: float,
                 device: torch.device, dtype: torch.dtype, varlen: Callable[..., Any]) -> str:
        q, k, v = _random_qkv(rows, heads, head_dim, device, dtype)
        real = max(1, 2 * rows // 3)  # the bottom of the budget's range (module docstring)
        offsets = torch.tensor([0, real, rows], dtype=torch.int32, device=device)
        segments = Segments(offsets, rows)
        # timed without the widening, which the graph does in the rotary embedding's kernel
        # (``_fused.rotate_qk_wide``), as flash varlen is timed without the rotary embedding
        wide = widen_for_dense(q, k, v, offsets[1:2])
        ms = _race(rows, "full attention", {
            # segment attention: cuDNN where it serves, else flash varlen
            "varlen": lambda: varlen_attention(q, k, v, segments, scale, varlen,
                                               self.graph_kernel(rows)),
            "dense": lambda: dense_sdpa(wide, head_dim, scale)}, real, self.timings)
        if ms is None:
            return "varlen"
        choice = "dense" if ms["dense"] < _DENSE_MARGIN * ms["varlen"] else "varlen"
        log.info("vitgraph: %d rows, full attention: %s (segments %.3f ms, dense %.3f ms)",
                 rows, choice, ms["varlen"], ms["dense"])
        return choice


def full_layouts(rows: int, frames: int) -> list[list[int]]:
    """The full-attention offsets a budget of ``rows`` static rows and ``frames`` frame slots is
    timed on: one image of all its rows and one of two thirds (the two ends of the budget's
    range, module docstring), and with several slots also two images of a third each; then
    the graph's empty frame slots and its padding segment."""
    real = max(1, 2 * rows // 3)
    images = [[rows], [real]] + ([[real // 2, real - real // 2]] if frames > 1 else [])
    layouts = []
    for lengths in images:
        ends = [*lengths, *[0] * max(0, frames - len(lengths)), rows - sum(lengths)]
        layouts.append([0, *itertools.accumulate(ends)])
    return layouts


def _timed_on(device: torch.device) -> bool:
    """Kernels are timed against each other on CUDA only (CUDA-graph replays)."""
    return torch.device(device).type == "cuda"


class _FirstServing:
    """The Triton segment kernel, then cuDNN's where it does not serve a call (``None`` from
    both: flash varlen serves); called like ``RaggedAttention``."""

    def __init__(self, first: SegmentFlashAttention | None, then: RaggedAttention | None
                 ) -> None:
        self.first, self.then = first, then

    def __call__(self, *args: Any) -> torch.Tensor | None:
        out = self.first(*args) if self.first is not None else None
        if out is None and self.then is not None:
            out = self.then(*args)
        return out


def _random_qkv(rows: int, heads: int, head_dim: int, device: torch.device, dtype: torch.dtype
                ) -> tuple[torch.Tensor, ...]:
    """Unit-variance q, k and v of a budget's shapes, the same for every run of that budget."""
    gen = torch.Generator(device=device).manual_seed(rows)
    return tuple(torch.randn(rows, heads, head_dim, device=device, dtype=dtype, generator=gen)
                 for _ in range(3))


def _race(rows: int, what: str, kernels: dict[str, Callable[[], torch.Tensor | None]],
          compared: int, timings: dict[int, dict[str, float]]) -> dict[str, float] | None:
    """Each of ``kernels`` (``"varlen"``, the one that serves otherwise, and its rival), timed
    from CUDA-graph replays (``gpu_timing.graph_ms``) on the budget of ``rows`` static rows; the
    times are also kept in ``timings``. ``None`` (``"varlen"`` serves) where a kernel raises or
    refuses (returns ``None``), or where the two disagree over the first ``compared`` rows."""
    try:
        with torch.no_grad():
            outs = [run() for run in kernels.values()]
            if any(out is None for out in outs):  # refused (its reason is in its state)
                return None
            diff = (outs[0][:compared].float() - outs[1][:compared].float()).abs().max().item()
            with torch.cuda.device(outs[0].device):  # graph_ms captures on the current device
                ms = {name: graph_ms(run) for name, run in kernels.items()}
    except Exception as exc:  # a kernel that refuses these shapes: flash varlen serves
        log.warning("vitgraph: %s not timed for %d rows (%s); the varlen kernel serves",
                    what, rows, error_line(exc))
        return None
    timings[rows] = {key: round(value, 4) for key, value in ms.items()}
    if not diff <= _AGREE:  # also NaN
        log.warning("vitgraph: %s for %d rows: the kernels disagree (max abs difference %.3g); "
                    "the varlen kernel serves", what, rows, diff)
        return None
    return ms
