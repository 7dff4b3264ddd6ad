"""Which attention kernel each budget's graph runs, chosen by timing at capture time.

Full attention runs cuDNN where it imports, else flash varlen; the Triton segment kernel is timed
against it per budget, window layers time the short-segment kernel against flash varlen, and
``"auto"`` times dense SDPA for one-segment budgets. No kernel wins everywhere, so each race runs
on the budget's own shapes near the bottom of its range, checks the kernels agree and keeps the
faster, timed from CUDA-graph replays (single launches would measure host time). Under
``use_cache_dir`` a later process reads the choices instead of timing again.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch

from ..cache_dir import keep_choice, kept_choice
from ..errors import InvalidOptionError, MissingDependencyError, error_line
from ..runtime.timing import choice_key, graph_ms
from .cudnn_attention import RaggedAttention, cudnn_frontend_reason
from .packed_attention import Segments, dense_sdpa, varlen_attention, widen_for_dense
from .segment_attention import SegmentFlashAttention
from .short_attention import ShortSegmentAttention, triton_reason

__all__ = ["ATTENTION_SETTINGS", "AttentionChoice"]

log = logging.getLogger(__name__)

#: ``attention`` values besides ``None`` (the default: cuDNN where it imports, else flash varlen).
ATTENTION_SETTINGS = ("auto", "varlen", "dense", "cudnn")

#: Dense attention is kept only when timed at least this much faster: its graph also widens q,
#: k and v inside the rotary kernel, which the timing leaves out.
_DENSE_MARGIN = 0.9

#: Largest max-abs difference between two kernels on unit-variance bf16 inputs that counts as
#: agreeing (a wrong kernel is off by ~1).
_AGREE = 5e-2


class AttentionChoice:
    """The ``attention`` setting of one adapter and the kernel chosen for each budget.

    Args:
        setting: ``None`` (default: cuDNN segment attention where ``nvidia-cudnn-frontend``
            imports, else flash varlen), ``"cudnn"`` (the same, an error without the library),
            ``"varlen"`` (flash varlen always, windows included), ``"auto"`` (time dense against
            segment attention per one-segment budget, on CUDA) or ``"dense"`` (dense SDPA
            wherever a budget holds one real segment).

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
        #: why cuDNN segment attention is off (``None``: on)
        self.cudnn_off = "packed_attention='varlen'" if setting == "varlen" else cudnn_frontend_reason()
        if setting == "cudnn" and self.cudnn_off is not None:
            raise MissingDependencyError(f"packed_attention='cudnn' needs cuDNN's frontend: "
                                         f"{self.cudnn_off}")
        #: cuDNN segment attention for the graphs, or ``None`` (flash varlen serves)
        self.ragged = RaggedAttention() if self.cudnn_off is None else None
        #: static row count of a captured budget -> "dense" or "varlen" (segment attention)
        self.by_rows: dict[int, str] = {}
        #: static row count -> measured ms per kernel (``auto`` only)
        self.timings: dict[int, dict[str, float]] = {}
        #: why window layers never run the short-segment kernel (``None``: measured per budget)
        self.short_off = "packed_attention='varlen'" if setting == "varlen" else triton_reason()
        #: the short-segment kernel for window layers, or ``None`` (flash varlen serves)
        self.short = ShortSegmentAttention() if self.short_off is None else None
        #: static row count -> window layers' kernel ("short" or "varlen")
        self.window_by_rows: dict[int, str] = {}
        #: static row count -> the window kernels' measured ms
        self.window_timings: dict[int, dict[str, float]] = {}
        #: why full attention never runs the Triton segment kernel (``None``: timed per budget)
        self.segment_off = (f"packed_attention={setting!r}" if setting in ("varlen", "cudnn")
                            else triton_reason())
        #: the Triton segment kernel for full attention, or ``None``
        self.segment = SegmentFlashAttention() if self.segment_off is None else None
        #: static row count -> full attention's segment kernel ("triton" or "varlen")
        self.full_by_rows: dict[int, str] = {}
        #: static row count -> the full segment kernels' measured ms
        self.full_timings: dict[int, dict[str, float]] = {}
        #: "full", "window" or "dense" -> row counts whose choice was read back, untimed
        self.kept: dict[str, list[int]] = {}

    def prepare(self, rows: int, heads: int, head_dim: int, scale: float, *, one_segment: bool,
                device: torch.device, dtype: torch.dtype,
                varlen: Callable[..., Any] | None,
                windows: tuple[int, int] | None = None, frames: int = 1) -> str:
        """Choose the kernels of the budget of ``rows`` static rows, before its capture; returns
        ``"dense"`` or ``"varlen"``. ``windows``: ``(rows of a full window, window slots)`` of a
        tower with window layers; ``frames``: full attention's segment slots besides padding."""
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
        """Full attention's segment kernel for the budget of ``rows`` static rows: Triton where
        timed faster (falling back to cuDNN), else cuDNN, or ``None`` (flash varlen). Never while
        an inner compiler traces."""
        if torch.compiler.is_compiling():
            return None
        if self.full_by_rows.get(rows) == "triton":
            return _FirstServing(self.segment, self.ragged)
        return self.ragged

    def window_kernel(self, rows: int) -> ShortSegmentAttention | None:
        """The short-segment kernel where chosen for the budget of ``rows`` static rows, else
        ``None`` (flash varlen). Never while an inner compiler traces (one trace, every budget)."""
        if torch.compiler.is_compiling() or self.window_by_rows.get(rows) != "short":
            return None
        return self.short

    def dense(self, rows: int) -> bool:
        """True if the budget of ``rows`` static rows runs dense attention; never while an inner
        compiler traces (a choice per row count would specialize its symbolic trace)."""
        return not torch.compiler.is_compiling() and self.by_rows.get(rows) == "dense"

    @property
    def state(self) -> dict[str, Any]:
        """The setting, each captured budget's kernel by its static row count, the timings, and
        (``kept``) the row counts whose choice was read back from an earlier process, untimed."""
        return {"attention": self.setting, "kept": {k: sorted(v) for k, v in self.kept.items()},
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

    def _kept(self, what: str, allowed: tuple[str, ...], device: torch.device, rows: int,
              *shape: Any) -> tuple[str | None, str | None]:
        """The key of race ``what`` on this budget (``runtime.timing.choice_key``), and the
        choice an earlier timing kept under it (``use_cache_dir``) if ``allowed``, recorded in
        ``kept`` (such a budget has no timings)."""
        key = choice_key(f"{what} attention", device, rows, *shape)
        kept = kept_choice(key)
        if kept not in allowed:
            return key, None
        self.kept.setdefault(what, []).append(rows)
        log.info("vitgraph: %d rows, %s attention: %s, as kept from an earlier timing", rows,
                 what, kept)
        return key, kept

    def _choose_window_kernel(self, rows: int, heads: int, head_dim: int, scale: float,
                              windows: tuple[int, int], device: torch.device,
                              dtype: torch.dtype, varlen: Callable[..., Any] | None) -> str:
        """Time the short-segment kernel against flash varlen on the budget's window layout."""
        window, slots = windows
        if self.short is None or varlen is None or not _timed_on(device) or window < 1:
            return "varlen"
        key, kept = self._kept("window", ("short", "varlen"), device, rows, heads, head_dim,
                               window, slots, dtype)
        if kept is not None:
            return kept
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
        keep_choice(key, choice)
        log.info("vitgraph: %d rows, window attention: %s (flash varlen %.3f ms, short-segment "
                 "kernel %.3f ms)", rows, choice, ms["varlen"], ms["short"])
        return choice

    def _choose_segment_kernel(self, rows: int, heads: int, head_dim: int, scale: float,
                               frames: int, device: torch.device, dtype: torch.dtype,
                               varlen: Callable[..., Any] | None) -> str:
        """Time the Triton segment kernel against cuDNN (else flash varlen); ``"triton"`` if faster."""
        if self.segment is None or varlen is None or not _timed_on(device):
            return "varlen"
        key, kept = self._kept("full", ("triton", "varlen"), device, rows, heads, head_dim,
                               frames, dtype, self.ragged is not None)
        if kept is not None:
            return kept
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
        self.full_timings[rows] = {name: round(value, 4) for name, value in total.items()}
        choice = "triton" if total["triton"] < total["varlen"] else "varlen"
        keep_choice(key, choice)
        log.info("vitgraph: %d rows, full attention over segments: %s (%s %.3f ms, Triton "
                 "segment kernel %.3f ms)", rows, choice,
                 "cuDNN" if self.ragged is not None else "flash varlen", total["varlen"],
                 total["triton"])
        return choice

    def _measure(self, rows: int, heads: int, head_dim: int, scale: float,
                 device: torch.device, dtype: torch.dtype, varlen: Callable[..., Any]) -> str:
        key, kept = self._kept("dense", ("dense", "varlen"), device, rows, heads, head_dim,
                               dtype, self.full_by_rows.get(rows), self.ragged is not None)
        if kept is not None:
            return kept
        q, k, v = _random_qkv(rows, heads, head_dim, device, dtype)
        real = max(1, 2 * rows // 3)  # the bottom of the budget's range (module docstring)
        offsets = torch.tensor([0, real, rows], dtype=torch.int32, device=device)
        segments = Segments(offsets, rows)
        # the graph widens inside the rotary kernel, so the timing leaves it out
        wide = widen_for_dense(q, k, v, offsets[1:2])
        ms = _race(rows, "full attention", {
            "varlen": lambda: varlen_attention(q, k, v, segments, scale, varlen,
                                               self.graph_kernel(rows)),
            "dense": lambda: dense_sdpa(wide, head_dim, scale)}, real, self.timings)
        if ms is None:
            return "varlen"
        choice = "dense" if ms["dense"] < _DENSE_MARGIN * ms["varlen"] else "varlen"
        keep_choice(key, choice)
        log.info("vitgraph: %d rows, full attention: %s (segments %.3f ms, dense %.3f ms)",
                 rows, choice, ms["varlen"], ms["dense"])
        return choice


def full_layouts(rows: int, frames: int) -> list[list[int]]:
    """The full-attention offsets a budget is timed on: one image of all ``rows`` and one of two
    thirds (the ends of its range), with several ``frames`` also two of a third each; then the
    graph's empty frame slots and its padding segment."""
    real = max(1, 2 * rows // 3)
    images = [[rows], [real]] + ([[real // 2, real - real // 2]] if frames > 1 else [])
    layouts = []
    for lengths in images:
        ends = [*lengths, *[0] * max(0, frames - len(lengths)), rows - sum(lengths)]
        layouts.append([0, *itertools.accumulate(ends)])
    return layouts


def _timed_on(device: torch.device) -> bool:
    """Kernels are timed on CUDA only."""
    return torch.device(device).type == "cuda"


class _FirstServing:
    """The Triton segment kernel, then cuDNN's where it refuses a call; called like ``RaggedAttention``."""

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
    """Each kernel's graph-replay time (also kept in ``timings``), or ``None`` (``"varlen"``
    serves) where one raises or refuses, or they disagree over the first ``compared`` rows."""
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
