"""What a served encoder promises about its weights, and the one check per call that keeps it.

Parameters and buffers may change value in place at any time: graphs read them where they live.
A weight given new storage (``.to()``, ``assign=True``, ``p.data = t``, a write to a parameter
table) is seen by :class:`WeightSlots` before any graph of a call launches, and the graphs are
captured again. Anything else (a replaced submodule, a hook added, patched code) is the user's to
announce with ``refresh()``; hooks and patched code present at capture are found then
(:func:`python_outside_graphs`) and the encoder is served eagerly. The check compares every
weight's address with the captured one, in one C call where the torch build has it, as
PyTorch's CUDA graph trees check static inputs (``_compat.data_ptrs_equal``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import nn

from .. import _compat

__all__ = ["DISPATCHES_TO_BASE", "WeightSlots", "fingerprint", "python_outside_graphs"]

#: Set on a class whose ``forward`` only runs its base class's as a nested compile region
#: (``compile/regions.py``): the base's ``forward`` is the code to check.
DISPATCHES_TO_BASE = "_vitgraph_dispatches_to_base"

_data_ptr = torch.Tensor.data_ptr
_version = operator.attrgetter("_version")


class WeightSlots:
    """Every parameter and buffer of ``module``'s tree (its table, name and address when read).
    For a wrapper tensor subclass (a quantized weight) the addresses of the tensors it holds
    (``__tensor_flatten__``) are compared."""

    def __init__(self, module: nn.Module) -> None:
        tables, names = [], []
        for sub in module.modules():
            for table in (_compat.parameter_table(sub), _compat.buffer_table(sub)):
                for name, tensor in table.items():
                    if isinstance(tensor, torch.Tensor):
                        tables.append(table)
                        names.append(name)
        self._slots = (tuple(tables), tuple(names))
        tensors = self.read()
        self._addresses = [_data_ptr(t) for t in tensors]
        self._wrapped = {i: _held(t) for i, t in enumerate(tensors)
                         if type(t) not in _PLAIN}
        self._plain = [i for i in range(len(tensors)) if i not in self._wrapped]

    def read(self) -> list[Any]:
        """The tensors in the slots now (``None`` where one was deleted)."""
        return list(map(dict.get, *self._slots))

    def moved(self) -> bool:
        """Whether any weight lives elsewhere than when the slots were read."""
        tensors = self.read()
        try:
            if not _compat.data_ptrs_equal(tensors, self._addresses, self._plain):
                return True
            return any(_held(tensors[i]) != held for i, held in self._wrapped.items())
        except (AttributeError, TypeError, RuntimeError):  # a slot emptied or holding no tensor
            return True

    def places(self) -> set[tuple[torch.device, torch.dtype]]:
        """The devices and dtypes of the floating weights now."""
        return {(t.device, t.dtype) for t in self.read()
                if isinstance(t, torch.Tensor) and t.is_floating_point()}


_PLAIN = (torch.Tensor, nn.Parameter, nn.Buffer) if hasattr(nn, "Buffer") else (
    torch.Tensor, nn.Parameter)


def _held(tensor: torch.Tensor) -> tuple[int, ...]:
    """The addresses of the tensors a wrapper subclass holds, depth first."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return (_data_ptr(tensor),)
    names, _ = flatten()
    return tuple(p for name in names for p in _held(getattr(tensor, name)))


def fingerprint(tensors: list[Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each tensor's address and version counter (-1 for ``None``), which derived weight copies
    compare to know whether their sources were written or moved. Raises ``RuntimeError`` for an
    inference tensor, which keeps no version counter."""
    try:
        return tuple(map(_data_ptr, tensors)), tuple(map(_version, tensors))
    except (TypeError, AttributeError):  # a projection without a bias: None in its slot
        return (tuple(-1 if t is None else _data_ptr(t) for t in tensors),
                tuple(-1 if t is None else t._version for t in tensors))


def python_outside_graphs(module: nn.Module) -> str | None:
    """Why calls of ``module`` would run Python that its captured graphs skip (a forward hook on
    a submodule or a global one, a ``forward`` set on an instance or patched into a class), or
    ``None``. ``module``'s own hooks are fine: they run around the whole call, and so is a
    ``forward`` marked as a nested compile region (``compile/regions.py``)."""
    pre, post = _compat.global_forward_hook_tables()
    if pre or post:
        return "a global forward hook is registered"
    for name, sub in module.named_modules():
        if sub is module:
            continue
        pre, post = _compat.forward_hook_tables(sub)
        if pre or post:
            return f"{name} has forward hooks"
        if "forward" in vars(sub):
            return f"{name} has a forward set on the instance"
        owner = next((c for c in type(sub).__mro__
                      if "forward" in vars(c) and DISPATCHES_TO_BASE not in vars(c)), None)
        # a nested compile region runs its function unchanged outside a compile
        forward = _compat.region_body(vars(owner).get("forward")) if owner is not None else None
        if getattr(forward, "__module__", owner.__module__ if owner else None) != (
                owner.__module__ if owner else None):
            return (f"{name}'s class {owner.__qualname__} runs a forward patched in from "
                    f"{forward.__module__}")
    return None
