"""Zero-padded copies of a tower's MLP weights, so cuBLAS takes its fast GEMM kernels.

Qwen2.5-VL's vision MLP has ``intermediate_size=3420``, not a multiple of 8: bf16 rows of 3420
elements are not 16-byte aligned, and cuBLAS falls back to slower kernels for all three GEMMs of
every block. Padding the intermediate dimension with zeros changes no number (padded gate/up rows
and biases are zero, and the padded columns of the down projection are zero, so whatever the padded
activations hold is multiplied by zero) and on an H100 makes the 32 MLPs of the 3B tower 2.6x faster
at 4096 rows (18.7 -> 6.9 ms; ``benchmarks/diagnose.py mlp``). Padding to a multiple of 8 measured
the same as a multiple of 64, so the pad is the smallest that aligns.

A SiLU-gated MLP whose first half runs through ``fused_linear.linear_silu_mul`` (``gated=True``)
keeps its gate and up weights as one packed copy instead (``fused_linear.pack_gated``: chunks of
128 rows alternating, the width padded to a multiple of 128, 3420 -> 3456): one GEMM of twice the
width, whose fused epilogue writes only ``silu(gate) * up``. The plain path reads the same copy as
one cuBLAS GEMM and takes the gate and up halves as views.

The padded tensors are copies (the tower's own parameters are left alone, so saving, loading and
``.to()`` behave as before); :meth:`AlignedMLPs.refresh` brings them in step with the originals
whenever a parameter was written in place, given new storage or replaced, copying into the same
padded storage so a captured graph keeps reading valid weights. Copies a graph was captured with
are ``pinned``: never freed nor moved, so a graph launched before a check reads valid memory; a
parameter moved to another device or dtype, or of another shape, then raises
:class:`CopiesPinned`, and the graphs are captured again (``_qwen_kernels.KernelChoices.sync``). A replaced parameter is read from
its module's parameter table at every call: accelerate's ``set_module_tensor_to_device`` (how
Hugging Face loads with a ``device_map``) writes that table directly, which no registration hook
sees, so copies checked against parameters listed earlier would go stale without an error
(``tests/unit/test_adapters_aligned_mlp.py``). In-projection biases always have padded storage
(zeros for a projection without one), so a bias added or removed later is followed too.
Parameters created under ``torch.inference_mode`` (inference tensors) keep no version counter,
so an in-place write to them could not be seen:
``refresh`` raises :class:`UntrackedWeights` for them, and the adapter runs the tower's own MLPs
instead of copies that might go stale (``_qwen_kernels.KernelChoices.sync``).
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
from ..kernels.fused_linear import (
    GATE_CHUNK,
    GATED,
    gated_width,
    linear_act,
    linear_silu_mul,
    pack_gated,
)
from ..runtime.weights import fingerprint

__all__ = ["ALIGNMENT", "AlignedMLPs", "CopiesPinned", "MLPWeights", "UntrackedWeights",
           "intermediate_size", "is_silu", "mlp_linears"]

#: Elements per row that make a bf16/fp16 GEMM operand 16-byte aligned.
ALIGNMENT = 8

_lookup = dict.get


class UntrackedWeights(RuntimeError):
    """The MLP parameters are inference tensors: in-place writes to them leave no trace."""


class CopiesPinned(RuntimeError):
    """The copies are pinned (a captured graph reads them) and cannot follow the parameters in
    place: these moved to another device or dtype, or changed shape."""


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
    """One block's padded weights: ``ins`` as ``(weight, bias)`` pairs (a bias of zeros for a
    projection without one), then the out projection's weight (its bias needs no padding: the
    graphs read the module's own)."""

    ins: list[tuple[torch.Tensor, torch.Tensor]]
    out_weight: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        """Every padded tensor of the block."""
        return [t for pair in self.ins for t in pair] + [self.out_weight]


class AlignedMLPs:
    """Padded MLP weights for every block of a tower, refreshed from the originals.

    Args:
        mlps: each block's MLP module (all of one shape).
        gated: keep a gate/up MLP's two in projections as one packed copy (see the module's
            docstring); ignored for fc1/fc2 MLPs.
    """

    def __init__(self, mlps: Sequence[nn.Module], gated: bool = False) -> None:
        self.mlps = list(mlps)
        shapes = {_shape(m) for m in self.mlps}
        if len(shapes) != 1 or None in shapes:
            raise ValueError("AlignedMLPs needs MLPs of one known shape (gate/up/down or fc1/fc2)")
        self.ins, self.out = shapes.pop()  # type: ignore[misc]
        width = getattr(self.mlps[0], self.out).in_features
        self.width = width
        #: the gate and up projections packed into one weight (``fused_linear.pack_gated``)
        self.gated = gated and len(self.ins) == 2
        self.padded_width = (gated_width(width) if self.gated
                             else ceil_div(width, ALIGNMENT) * ALIGNMENT)
        self.weights: list[MLPWeights] = []
        #: the parameters' (addresses, versions) at the last copy (``weights.fingerprint``)
        self._fingerprint: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        #: (parameter tables, names) of every parameter the copies are made from
        self._slots = self._read_slots()
        #: the fingerprint's parameters found to be inference tensors (refused without a scan)
        self._untracked: list[torch.Tensor | None] | None = None
        #: a captured graph reads the copies: they are never freed nor moved, only written
        self.pinned = False

    @staticmethod
    def needed(mlps: Sequence[nn.Module], gated: bool = False) -> bool:
        """True if the MLPs have a known shape whose intermediate width is misaligned, or
        ``gated`` and they are gate/up MLPs (the packed copy is wanted whatever the width)."""
        widths = {intermediate_size(m) for m in mlps}
        if len(widths) != 1 or None in widths:
            return False
        return widths.pop() % ALIGNMENT != 0 or (gated and len(_shape(mlps[0])[0]) == 2)

    @property
    def nbytes(self) -> int:
        """Bytes the padded copies hold."""
        return sum(t.numel() * t.element_size() for w in self.weights for t in w.tensors())

    def _read_slots(self) -> tuple[tuple[dict[str, Any], ...], tuple[str, ...]]:
        """Where each parameter the copies are made from lives: its module's parameter table and
        name (not the out projection's bias, which is read where it is: one tensor fewer per
        block to check before every call)."""
        tables, names = [], []
        for mlp in self.mlps:
            for name in self.ins:
                table = parameter_table(getattr(mlp, name))
                tables += [table, table]
                names += ["weight", "bias"]
            tables.append(parameter_table(getattr(mlp, self.out)))
            names.append("weight")
        return tuple(tables), tuple(names)

    def refresh(self) -> bool:
        """Bring the padded copies in step with the MLPs' parameters; True if anything was
        copied. Cheap when nothing changed: one pass over the parameter tables, addresses and
        version counters (the modules are walked again only after a parameter was registered
        somewhere)."""
        params = list(map(_lookup, *self._slots))  # C-level, like fingerprint
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
        # only the heads above are ever written: the padding stays zero
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

        # a bias for every in projection, zeros where it has none: one added later has room
        if self.gated:  # one packed weight, twice the padded width
            gate = getattr(mlp, self.ins[0])
            ins = [(zeros_like_padded(gate.weight, 0, 2), zeros_like_padded(gate.weight[0], 0, 2))]
        else:
            ins = [(zeros_like_padded(linear.weight, 0), zeros_like_padded(linear.weight[0], 0))
                   for linear in (getattr(mlp, name) for name in self.ins)]
        return MLPWeights(ins, zeros_like_padded(getattr(mlp, self.out).weight, 1))

    def forward(self, layer: int, x: torch.Tensor,
                silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                epilogue: str | None = None) -> torch.Tensor:
        """Block ``layer``'s MLP on ``x`` with the padded weights (same math as the module).
        ``silu_mul(gate, up)``, if given, replaces ``act(gate) * up`` when ``act`` is SiLU;
        ``epilogue`` (``_qwen_kernels`` checked it names ``act``), if given, runs the first half
        through ``fused_linear``'s ops: ``fused_linear.GATED`` as ``linear_silu_mul``, a GELU's
        name as ``linear_act``."""
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
