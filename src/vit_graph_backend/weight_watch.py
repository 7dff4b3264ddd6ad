"""`WeightWatch`: whether a module's weights still live where its graphs were captured.

A captured graph reads every weight by address. ``.to()``, ``.half()`` or ``load_state_dict(...,
assign=True)`` give a whole module new storage and free the old one; a graph replayed after that
reads freed memory and returns wrong numbers without an error (an H100 run:
``benchmarks/results/packed_served_tower_new_storage_recapture_*``). Every one of those moves
every parameter, so watching one, the first, catches them for the price of a dictionary read and
an address (0.2 us on a CPU core). A single parameter given new storage by hand (``p.data = t``)
is not caught here; the Qwen adapters' padded MLP copies follow their own parameters
(``adapters/_aligned_mlp.py``), and batched graphs check every tensor they read (``batched.py``).

:class:`~vit_graph_backend.runtime.EncoderCudaGraphManager` watches its encoder (or the module
given as ``watch``) before every call: it captures again when the weights moved on the same device
and dtype, and turns its graphs off with the reason otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._compat import parameter_table

__all__ = ["WeightWatch"]


class WeightWatch:
    """A module's first parameter and the address it had when the watch was made."""

    def __init__(self, owner: nn.Module, name: str, param: torch.Tensor) -> None:
        self._params = parameter_table(owner)  # what assigning a parameter writes to
        self._name, self._ptr = name, param.data_ptr()

    @staticmethod
    def of(module: Any) -> WeightWatch | None:
        """A watch on ``module``'s first parameter (``None`` for no module or no parameter)."""
        if not isinstance(module, nn.Module):
            return None
        for name, param in module.named_parameters():
            prefix, _, attr = name.rpartition(".")
            return WeightWatch(module.get_submodule(prefix), attr, param)
        return None

    def param(self) -> torch.Tensor | None:
        """The watched parameter now (``None`` if it was removed)."""
        return self._params.get(self._name)

    def moved(self) -> bool:
        """Whether the parameter is gone or has other storage than when watched."""
        param = self.param()
        return param is None or param.data_ptr() != self._ptr
