"""Zero-padded copies of a tower's MLP weights, so cuBLAS takes its fast GEMM kernels.

An intermediate width that is not a multiple of 8 (Qwen2.5-VL's 3420) leaves bf16 rows unaligned,
and cuBLAS falls back to slower kernels for every MLP GEMM (docs/performance.md). Zero padding
changes no number. With ``gated=True`` a SiLU-gated MLP keeps gate and up as one packed copy
(``fused_linear.pack_gated``), read as one GEMM.

The tower's own parameters are left alone (saving, loading, ``.to()`` unchanged).
:meth:`AlignedMLPs.refresh` follows in-place writes, new storage and replaced parameters (read
from their module's parameter table each time: accelerate writes that table directly), copying
into the same storage. Copies a graph was captured with are ``pinned``, so a move or shape change
raises :class:`CopiesPinned`; inference tensors keep no version counter, so they raise
:class:`UntrackedWeights`. Either way the adapter runs the tower's own MLPs
(``kernel_choices.KernelChoices.sync``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._compat import parameter_table
from ..budgets import ceil_div
from ..kernels.fused_linear import (GATE_CHUNK, GATED, gated_width, linear_act, linear_silu_mul,
                                     pack_gated)
from ..runtime.weights import fingerprint

__all__ = ["ALIGNMENT", "AlignedMLPs", "CopiesPinned", "MLPWeights", "UntrackedWeights",
           "intermediate_size", "is_silu", "mlp_linears"]

#: Elements per row that make a bf16/fp16 GEMM operand 16-byte aligned.
ALIGNMENT = 8

_lookup = dict.get
_version = operator.attrgetter("_version")


class UntrackedWeights(RuntimeError):
    """The MLP parameters are inference tensors: in-place writes to them leave no trace."""


class CopiesPinned(RuntimeError):
    """Pinned copies (a graph reads them) cannot follow parameters that moved or changed shape."""


_UNTRACKED = ("the tower's MLP parameters are inference tensors (made under torch.inference_mode), "
              "whose in-place updates cannot be detected")

#: (in projections, out projection) attribute names of the MLP shapes the Qwen towers use.
_SHAPES = ((("gate_proj", "up_proj"), "down_proj"),   # Qwen2.5-VL: down(act(gate x) * up x)
           (("fc1",), "fc2"),                        # Qwen2-VL: fc2(act(fc1 x))
           (("linear_fc1",), "linear_fc2"))          # Qwen3-VL: linear_fc2(act(linear_fc1 x))


def is_silu(act: object) -> bool:
    """Whether ``act`` is a SiLU module."""
    # transformers 5 wraps F.silu in its own SiLUActivation; older releases used nn.SiLU
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _shape(mlp: nn.Module) -> tuple[tuple[str, ...], str] | None:
    for ins, out in _SHAPES:
        if all(isinstance(getattr(mlp, n, None), nn.Linear) for n in (*ins, out)):
            return ins, out
    return None


def mlp_linears(mlp: nn.Module) -> tuple[tuple[nn.Linear, ...], nn.Linear] | None:
    """The MLP's in projections and out projection, or ``None`` if it is not a known shape."""
    shape = _shape(mlp)
    if shape is None:
        return None
    return tuple(getattr(mlp, n) for n in shape[0]), getattr(mlp, shape[1])


def intermediate_size(mlp: nn.Module) -> int | None:
    """The MLP's intermediate width, or ``None`` if it is not a known shape."""
    shape = _shape(mlp)
    return None if shape is None else getattr(mlp, shape[1]).in_features


@dataclass
class MLPWeights:
    """One block's padded weights: ``ins`` as ``(weight, bias)`` pairs (zeros for a missing bias)
    and the out projection's weight (its bias needs no padding)."""

    ins: list[tuple[torch.Tensor, torch.Tensor]]
    out_weight: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        """Every padded tensor of the block."""
        return [t for pair in self.ins for t in pair] + [self.out_weight]


class AlignedMLPs:
    """Padded MLP weights for every block of a tower, refreshed from the originals.

    Args:
        mlps: each block's MLP module (all of one shape).
        gated: keep a gate/up MLP's in projections as one packed copy; ignored for fc1/fc2.
    """

    def __init__(self, mlps: Sequence[nn.Module], gated: bool = False) -> None:
        self.mlps = list(mlps)
        shapes = {_shape(m) for m in self.mlps}
        if len(shapes) != 1 or None in shapes:
            raise ValueError("AlignedMLPs needs MLPs of one known shape (gate/up/down or fc1/fc2)")
        self.ins, self.out = shapes.pop()  # type: ignore[misc]
        self.width = width = getattr(self.mlps[0], self.out).in_features
        self.gated = gated and len(self.ins) == 2
        self.padded_width = (gated_width(width) if self.gated
                             else ceil_div(width, ALIGNMENT) * ALIGNMENT)
        self.weights: list[MLPWeights] = []
        #: the parameters' (addresses, versions) at the last copy
        self._fingerprint: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        #: (parameter tables, names) of every parameter the copies are made from
        self._slots = self._read_slots()
        #: the parameters last found to be inference tensors (refused again without a scan)
        self._untracked: list[torch.Tensor | None] | None = None
        #: a captured graph reads the copies: they are never freed nor moved, only written
        self.pinned = False

    @staticmethod
    def needed(mlps: Sequence[nn.Module], gated: bool = False) -> bool:
        """True for MLPs of one known shape and a misaligned width (or gate/up, if ``gated``)."""
        widths = {intermediate_size(m) for m in mlps}
        if len(widths) != 1 or None in widths:
            return False
        return widths.pop() % ALIGNMENT != 0 or (gated and len(_shape(mlps[0])[0]) == 2)

    @property
    def nbytes(self) -> int:
        """Bytes the padded copies hold."""
        return sum(t.numel() * t.element_size() for w in self.weights for t in w.tensors())

    def _read_slots(self) -> tuple[tuple[dict[str, Any], ...], tuple[str, ...]]:
        """(parameter table, name) of each copied parameter (not the out bias, read in place)."""
        tables, names = [], []
        for mlp in self.mlps:
            for name in self.ins:
                table = parameter_table(getattr(mlp, name))
                tables += [table, table]
                names += ["weight", "bias"]
            tables.append(parameter_table(getattr(mlp, self.out)))
            names.append("weight")
        return tuple(tables), tuple(names)

    def refresh(self, replay: bool = False) -> bool:
        """Bring the padded copies in step with the MLPs' parameters; True if anything was
        copied. Unchanged parameters cost one pass over addresses and version counters; with
        ``replay`` (the runtime checked every address before the launch) over versions alone.

        Raises:
            UntrackedWeights: the parameters are inference tensors.
            CopiesPinned: pinned copies cannot follow a move or a shape change.
        """
        params = list(map(_lookup, *self._slots))  # C-level, like fingerprint
        if replay and self._fingerprint is not None and self._untracked is None:
            try:
                if tuple(map(_version, params)) == self._fingerprint[1]:
                    return False
            except (AttributeError, RuntimeError):  # None in a slot, or an inference tensor
                pass
        if self._untracked is not None and all(map(operator.is_, params, self._untracked)):
            raise UntrackedWeights(_UNTRACKED)  # the same tensors as last time: no scan per call
        try:
            now = fingerprint(params)
        except RuntimeError:  # "Inference tensors do not track version counter"
            if not any(p is not None and p.is_inference() for p in params):
                raise
            self._untracked = params
            raise UntrackedWeights(_UNTRACKED) from None
        self._untracked = None
        if now == self._fingerprint:
            return False
        # a Parameter made outside inference_mode from an inference tensor reads version 0 even
        # after in-place writes; a tensor is an inference tensor from birth, so new ones suffice
        if any(p is not None and p.is_inference() for p in params):
            self._untracked = params
            raise UntrackedWeights(_UNTRACKED)
        places = {(p.device, p.dtype) for p in params if p is not None}
        if not self.weights or places != {(w.out_weight.device, w.out_weight.dtype)
                                          for w in self.weights}:
            if self.pinned and self.weights:
                where = ", ".join(sorted(f"{d} {str(t).removeprefix('torch.')}" for d, t in places))
                raise CopiesPinned(f"the MLP parameters moved to {where}")
            self.weights = [self._allocate(mlp) for mlp in self.mlps]
        try:
            self._copy()
        except (RuntimeError, TypeError) as exc:  # a parameter of another shape, or removed
            if not self.pinned:
                raise
            raise CopiesPinned(f"an MLP parameter cannot be copied in place: {exc}") from None
        self._fingerprint = now
        return True

    def _copy(self) -> None:
        with torch.no_grad():
            for mlp, w in zip(self.mlps, self.weights):
                if self.gated:
                    self._pack(mlp, w)
                else:
                    for name, (weight, bias) in zip(self.ins, w.ins):
                        linear = getattr(mlp, name)
                        weight[:self.width].copy_(linear.weight)
                        if linear.bias is None:
                            bias.zero_()
                        else:
                            bias[:self.width].copy_(linear.bias)
                w.out_weight[:, :self.width].copy_(getattr(mlp, self.out).weight)

    def _pack(self, mlp: nn.Module, w: MLPWeights) -> None:
        gate, up = (getattr(mlp, name) for name in self.ins)
        (weight, bias), = w.ins
        pack_gated(gate.weight, up.weight, out=weight)
        # a missing bias is zeros
        pack_gated(*(bias.new_zeros(self.width) if b is None else b
                     for b in (gate.bias, up.bias)), out=bias)

    def _allocate(self, mlp: nn.Module) -> MLPWeights:
        def zeros_like_padded(t: torch.Tensor, dim: int, scale: int = 1) -> torch.Tensor:
            shape = list(t.shape)
            shape[dim] = self.padded_width * scale
            return torch.zeros(shape, device=t.device, dtype=t.dtype)

        # a bias for every in projection, zeros where it has none: one added later has room;
        # gated: one packed weight (shaped after the gate's), twice the padded width
        scale, names = (2, self.ins[:1]) if self.gated else (1, self.ins)
        ins = [(zeros_like_padded(lin.weight, 0, scale), zeros_like_padded(lin.weight[0], 0, scale))
               for lin in (getattr(mlp, name) for name in names)]
        return MLPWeights(ins, zeros_like_padded(getattr(mlp, self.out).weight, 1))

    def forward(self, layer: int, x: torch.Tensor,
                silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                epilogue: str | None = None) -> torch.Tensor:
        """Block ``layer``'s MLP on ``x`` with the padded weights (same math as the module).
        ``silu_mul`` replaces ``act(gate) * up`` for SiLU; ``epilogue`` runs the first half
        through ``fused_linear`` (``GATED``: ``linear_silu_mul``; a GELU: ``linear_act``)."""
        mlp, w = self.mlps[layer], self.weights[layer]
        act = mlp.act_fn if hasattr(mlp, "act_fn") else mlp.act
        if self.gated:
            ((pw, pb),) = w.ins
            if epilogue == GATED:
                hidden = linear_silu_mul(x, pw, pb)
            else:  # one GEMM; its gate and up chunks as views
                y = F.linear(x, pw, pb).unflatten(-1, (-1, 2, GATE_CHUNK))
                gate, up = y[..., 0, :], y[..., 1, :]
                hidden = (silu_mul(gate, up) if silu_mul is not None and is_silu(act)
                          else act(gate) * up).flatten(-2)
        elif len(w.ins) == 2:
            (gw, gb), (uw, ub) = w.ins
            gate, up = F.linear(x, gw, gb), F.linear(x, uw, ub)
            hidden = silu_mul(gate, up) if silu_mul is not None and is_silu(act) else (
                act(gate) * up)
        else:
            ((fw, fb),) = w.ins
            hidden = linear_act(x, fw, fb, epilogue) if epilogue else act(F.linear(x, fw, fb))
        return F.linear(hidden, w.out_weight, getattr(mlp, self.out).bias)
