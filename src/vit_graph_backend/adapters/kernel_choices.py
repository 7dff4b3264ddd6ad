"""Which kernels a Qwen-VL adapter's graphs run: zero-padded MLP weights and fused ops.

One of the adapter's three parts (``qwen`` runs the blocks, ``packing`` lays out inputs). The
choices are made outside the graph, before every capture, replay and eager batch, so a captured
graph always reads up-to-date weights (``aligned_mlp``) and holds no Python state Dynamo would
guard on. They are made for the MLP modules the tower holds when served; a replaced submodule is
announced with ``served.refresh()`` (``runtime.weights``).
"""

from __future__ import annotations

import logging
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
        epilogue_fusion: ``"auto"``: with fusion on, an ``fc2(gelu(fc1 x))`` MLP runs fc1 and
            its GELU, and a SiLU-gated MLP ``silu(gate x) * up x`` from a packed gate/up copy,
            through ``fused_linear``'s ops (a GEMM epilogue where timed faster, else cuBLAS and
            one kernel); ``"off"``: never.
    """

    def __init__(self, tower: nn.Module, align_mlp: bool | None, fuse: bool | None,
                 epilogue_fusion: str = "auto") -> None:
        self.align_mlp, self.fuse, self.epilogue_fusion = align_mlp, fuse, epilogue_fusion
        #: the padded (or packed) weight copies; ``None`` when none is needed
        self.aligned: AlignedMLPs | None = None
        self.use_aligned = False
        #: why the padded copies are off although asked for (inference-tensor weights), or None
        self.untracked: str | None = None
        self._fusion_reason: dict[str, str | None] = {}
        mlps = tuple(getattr(block, "mlp", None) for block in getattr(tower, "blocks", ()))
        if any(getattr(m, "swiglu_limit", None) is not None for m in mlps):
            # a clamped gate (GLM-5.3): the padded and fused kernels have no clamp
            mlps, self.align_mlp = (), False
        kinds = ({_epilogue_of(m) for m in mlps} if mlps and epilogue_fusion == "auto"
                 else {None})
        #: the first half's ``fused_linear`` op: a GELU name, ``GATED``, or ``None``
        self.epilogue: str | None = kinds.pop() if len(kinds) == 1 else None
        gated = self.epilogue == GATED
        if None not in mlps and AlignedMLPs.needed(mlps, gated):
            self.aligned = AlignedMLPs(mlps, gated)

    def sync(self, device: torch.device, capture: bool = False, replay: bool = False) -> bool:
        """Decide whether the padded MLP weights are used on ``device`` and bring them up to
        date; True if one was copied. ``capture``: a graph is captured with them (they are then
        pinned); ``replay``: a graph replays them (the copies follow in place)."""
        if self.aligned is None:
            return False
        if replay:
            return self.aligned.pinned and self.aligned.refresh(replay=True)
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
        # inside an inner compiler's trace the compiler fuses plain ops (state read here: guards)
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
    """The GELU name of an fc1/fc2 MLP, ``GATED`` for a SiLU-gated one, else ``None``."""
    linears = mlp_linears(mlp)
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "act", None)
    if linears is None:
        return None
    if len(linears[0]) == 2:
        return GATED if is_silu(act) else None
    return activation_of(act)
