"""Which kernels a Qwen-VL adapter's graphs run: zero-padded MLP weights and Inductor-fused ops.

One of the three parts of the adapter (``qwen_vl.py``): this one decides kernels, ``_qwen_packing``
lays out inputs and metadata, the adapter class runs the blocks. The choices are made outside the
graph, before every capture, replay and eager batch, so a captured graph always reads weights that
are up to date (see ``_aligned_mlp``) and never holds Python state that Dynamo would guard on.

The choices are made for the MLP modules the tower holds when it is served; a submodule
replaced later is announced with ``served.refresh()``, which makes them again (``weights.py``:
the contract).
"""

from __future__ import annotations

import logging
from itertools import chain
from typing import Any

import torch
from torch import nn

from ..kernels.fused_linear import GATED, activation_of, linear_act
from .aligned_mlp import AlignedMLPs, CopiesPinned, UntrackedWeights, is_silu, mlp_linears
from ..kernels.fused_ops import Ops, fusion_available, ops

__all__ = ["KernelChoices"]

log = logging.getLogger(__name__)


class KernelChoices:
    """The ``align_mlp`` and ``fuse`` settings of one adapter, and what they resolve to per device.

    Args:
        tower: the vision tower; its blocks' MLP modules are what the choices are made for.
        align_mlp: ``None`` uses padded (or packed) MLP weight copies on CUDA only; ``True``
            everywhere; ``False`` never.
        fuse: ``None`` fuses the graph path's elementwise ops where Triton is available;
            ``True`` everywhere (Inductor's C++ code on CPU); ``False`` never.
        epilogue_fusion: ``"auto"``: with fusion on, an ``fc2(gelu(fc1 x))`` MLP (Qwen2-VL's
            quick GELU, Qwen3-VL's tanh GELU) runs its ``fc1`` and GELU as ``fused_linear``'s
            op: one GEMM with the GELU in its epilogue where that was timed faster on the shape
            (Hopper and newer), cuBLAS and one activation kernel otherwise; a SiLU-gated MLP
            (Qwen2.5-VL) runs ``silu(gate x) * up x`` through its gated op the same way, from a
            packed gate/up copy (``_aligned_mlp``; so not with ``align_mlp=False`` nor with
            inference-tensor weights, where the tower's own MLP runs); ``"off"``: never, and
            gated MLPs keep separate padded gate and up copies as before.

    """

    def __init__(self, tower: nn.Module, align_mlp: bool | None, fuse: bool | None,
                 epilogue_fusion: str = "auto") -> None:
        self.align_mlp, self.fuse = align_mlp, fuse
        self._tower, self.epilogue_fusion = tower, epilogue_fusion
        #: what the MLP's first half runs through ``fused_linear``'s ops: the GELU of an fc1/fc2
        #: MLP (``fused_linear.ACTIVATIONS``), ``fused_linear.GATED`` for a SiLU-gated one (from
        #: the packed copies, so only where those are in use), or ``None`` (other MLPs, MLPs of
        #: more than one kind, or ``epilogue_fusion="off"``)
        self.epilogue: str | None = None
        #: the zero-padded (for the gated op: packed) weight copies, or ``None`` when every MLP
        #: width is aligned already and no packed copy is wanted
        self.aligned: AlignedMLPs | None = None
        self.use_aligned = False
        #: why the padded copies are off although asked for (inference-tensor weights), or None
        self.untracked: str | None = None
        self._fusion_reason: dict[str, str | None] = {}
        mlps = tuple(getattr(block, "mlp", None) for block in getattr(tower, "blocks", ()))
        kinds = ({_epilogue_of(m) for m in mlps} if mlps and epilogue_fusion == "auto"
                 else {None})
        self.epilogue = kinds.pop() if len(kinds) == 1 else None
        gated = self.epilogue == GATED
        if None not in mlps and AlignedMLPs.needed(mlps, gated):
            self.aligned = AlignedMLPs(mlps, gated)

    def sync(self, device: torch.device, capture: bool = False, replay: bool = False) -> bool:
        """Decide whether the padded MLP weights are used on ``device`` and bring them up to
        date (a copy only after the tower's MLP parameters were written); True if one was
        copied. ``capture``: a CUDA graph is captured with the choices (the copies it reads are
        then pinned: ``_aligned_mlp``); ``replay``: a graph replays them (the runtime checked
        that no weight moved, so the copies follow in place)."""
        if self.aligned is None:
            return False
        if replay:
            return self.aligned.pinned and self.aligned.refresh()
        use = self.align_mlp if self.align_mlp is not None else torch.device(device).type == "cuda"
        copied = False
        if use:
            try:
                copied = self.aligned.refresh()
            except UntrackedWeights as exc:  # copies could go stale unseen: the tower's own MLPs
                use = False
                if self.untracked is None:
                    log.warning("vitgraph: padded MLP weights off: %s; build the tower outside "
                                "inference_mode to have them", exc)
                self.untracked = str(exc)
            except CopiesPinned as exc:  # graphs read them: this forward runs the tower's MLPs
                use = False
                log.info("vitgraph: padded MLP weights not used for this forward: %s", exc)
        if use and capture and torch.device(device).type == "cuda":
            self.aligned.pinned = True
        self.use_aligned = use
        return copied

    def mlp(self, fns: Ops, layer: int, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Block ``layer``'s MLP: from the padded copies when in use, else the tower's own."""
        epilogue = self.epilogue if fns is not ops(False) else None   # only where fusion is on
        if self.use_aligned and self.aligned is not None:
            return self.aligned.forward(layer, x, fns.silu_mul, epilogue)
        if epilogue is not None and epilogue != GATED:
            (fc1,), fc2 = mlp_linears(block.mlp)
            return fc2(linear_act(x, fc1.weight, fc1.bias, epilogue))
        return block.mlp(x)

    def ops_for(self, device: torch.device, graph: bool) -> Ops:
        """The compiled fused ops for the graph path where ``fuse`` allows, else plain ops."""
        # inside an inner compiler's trace, the compiler fuses the plain ops itself (and state
        # read here would become guards)
        if not graph or self.fuse is False or torch.compiler.is_compiling():
            return ops(False)
        if self.fuse is None:
            kind = torch.device(device).type
            if kind not in self._fusion_reason:
                self._fusion_reason[kind] = fusion_available(device)
            if self._fusion_reason[kind] is not None:
                return ops(False)
        return ops(True)

    @property
    def aligned_bytes(self) -> int:
        """Bytes held by the zero-padded MLP weight copies (0 when not in use)."""
        return self.aligned.nbytes if self.aligned is not None and self.use_aligned else 0

    @property
    def state(self) -> dict[str, Any]:
        """``fuse`` as given, the reason fusion is off per device type seen (``None``: on), and
        compile failures (functions then run unfused)."""
        return {"fuse": self.fuse, "unavailable": dict(self._fusion_reason),
                "compile_failures": ops(True).failures() if self.fuse is not False else {}}


def _epilogue_of(mlp: nn.Module) -> str | None:
    """The GELU of an ``fc2(act(fc1 x))`` MLP as ``fused_linear`` names it, ``GATED`` for a
    ``down(silu(gate x) * up x)`` one, else ``None``."""
    linears = mlp_linears(mlp)
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "act", None)
    if linears is None:
        return None
    if len(linears[0]) == 2:
        return GATED if is_silu(act) else None
    return activation_of(act)
