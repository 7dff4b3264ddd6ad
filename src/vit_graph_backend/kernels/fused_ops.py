"""The elementwise work of a Qwen vision block, fused by Inductor inside captured graphs.

Outside GEMMs and attention, a Qwen block's elementwise ops (above all the float32 rotary embedding
over strided q and k) take a large share of GPU time; a CUDA graph removes launches but not memory
traffic, which fusing removes (docs/performance.md). Each function is plain PyTorch with the Qwen
towers' numerics. :func:`ops` returns them as written or compiled with ``torch.compile`` (Inductor,
rows marked dynamic so one compile serves every budget), compiled only for the graph path on
CUDA, first called in a warm-up, never in a capture. A failed compile falls back to the functions
as written, with one logged reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .. import _compat
from .packed_attention import widen_for_dense

__all__ = ["Ops", "add_layer_norm", "add_rms_norm", "ops", "rotate_qk", "rotate_qk_wide",
           "silu_mul"]

log = logging.getLogger("vit_graph_backend")


def rotate_qk(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k in ``qkv`` (``(rows, 3, heads, head_dim)``), as HF's
    ``apply_rotary_pos_emb_vision``: float32 math, one rounding back to the input dtype.
    ``cos`` and ``signed_sin`` are ``(rows, 1, 1, head_dim)`` float32, ``signed_sin`` with its
    first half negated (``rotate_half(x) * sin == roll(x, half) * signed_sin``)."""
    qk = qkv[:, :2]
    rolled = torch.roll(qk, qk.shape[-1] // 2, dims=-1)
    q, k = torch.addcmul(qk * cos, rolled, signed_sin).to(qkv.dtype).unbind(1)
    return q, k


def rotate_qk_wide(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                   real: torch.Tensor) -> torch.Tensor:
    """:func:`rotate_qk` and v, widened for dense attention (``packed_attention.widen_for_dense``)
    into one ``(3, rows, heads, width)`` buffer, by one fused kernel when compiled."""
    q, k = rotate_qk(qkv, cos, signed_sin)
    return widen_for_dense(q, k, qkv[:, 2], real)


def add_rms_norm(hidden: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden + update, rms_norm(hidden + update) * weight)``: a residual add and the next
    RMSNorm (float32 statistics, one rounding to the input dtype)."""
    hidden = hidden + update
    return hidden, F.rms_norm(hidden, (hidden.shape[-1],), weight, eps)


def add_layer_norm(hidden: torch.Tensor, update: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden + update, layer_norm(hidden + update))``: a residual add and the next LayerNorm."""
    hidden = hidden + update
    return hidden, F.layer_norm(hidden, (hidden.shape[-1],), weight, bias, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: the gated activation of a SiLU-gated MLP."""
    return F.silu(gate) * up


#: Each function and which of its arguments carry the row dimension (dim 0).
_ROW_ARGS: dict[str, tuple[Callable[..., Any], tuple[int, ...]]] = {
    "rotate_qk": (rotate_qk, (0, 1, 2)),
    "rotate_qk_wide": (rotate_qk_wide, (0, 1, 2)),
    "add_rms_norm": (add_rms_norm, (0, 1)),
    "add_layer_norm": (add_layer_norm, (0, 1)),
    "silu_mul": (silu_mul, (0, 1)),
}


class _Compiled:
    """One function compiled on first use; falls back to the function as written, for good,
    if compiling or running the compiled code raises outside a capture."""

    def __init__(self, name: str, fn: Callable[..., Any], row_args: tuple[int, ...],
                 backend: Any = "inductor") -> None:
        self.name, self.fn, self.row_args, self.backend = name, fn, row_args, backend
        self.compiled: Callable[..., Any] | None = None
        self.failure: str | None = None

    def __call__(self, *args: Any) -> Any:
        # inside another torch.compile trace, the tracer fuses the plain ops itself
        if self.failure is not None or torch.compiler.is_compiling():
            return self.fn(*args)
        for i in self.row_args:
            _compat.maybe_mark_dynamic(args[i], 0)
        try:
            if self.compiled is None:
                self.compiled = torch.compile(self.fn, fullgraph=True, backend=self.backend)
            return self.compiled(*args)
        except Exception as exc:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise  # the runtime's capture fallback handles it
            self.failure = _reason(exc)
            log.warning("vitgraph: fused %s could not be compiled (%s); running it unfused",
                        self.name, self.failure)
            return self.fn(*args)


def _reason(exc: BaseException) -> str:
    """``Type: message`` of the innermost cause (Dynamo wraps a backend's error in its own)."""
    root = exc
    # Dynamo's BackendCompilerFailed keeps the backend's error as ``inner_exception``
    while (inner := root.__cause__ or getattr(root, "inner_exception", None)) is not None:
        root = inner
    lines = [line for line in str(root).splitlines() if line.strip()]
    return f"{type(root).__name__}: {lines[0] if lines else ''}"[:300]


class Ops:
    """The fused functions, compiled (``compiled=True``, with ``backend``: Inductor unless a
    test passes another) or as written."""

    def __init__(self, compiled: bool, backend: Any = "inductor") -> None:
        for name, (fn, row_args) in _ROW_ARGS.items():
            setattr(self, name, _Compiled(name, fn, row_args, backend) if compiled else fn)

    def failures(self) -> dict[str, str]:
        """Functions whose compile failed, with the reason (empty when all compiled or none)."""
        return {name: f.failure for name in _ROW_ARGS
                if isinstance(f := getattr(self, name), _Compiled) and f.failure}

    rotate_qk: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotate_qk_wide: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    add_layer_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_mul: Callable[..., torch.Tensor]


_PLAIN = Ops(compiled=False)
_COMPILED: Ops | None = None


def ops(compiled: bool) -> Ops:
    """The process-wide set of functions; compiled ones are shared by every adapter."""
    global _COMPILED
    if not compiled:
        return _PLAIN
    if _COMPILED is None:
        _COMPILED = Ops(compiled=True)
    return _COMPILED


def fusion_available(device: torch.device) -> str | None:
    """Why fused kernels cannot be compiled for ``device`` (needs CUDA and Triton), or ``None``."""
    if torch.device(device).type != "cuda":
        return f"fused kernels are compiled for CUDA only (device {device})"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (Inductor needs it to compile CUDA kernels)"
    return None
