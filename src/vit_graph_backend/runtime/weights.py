"""What a served encoder promises about its weights, and the one check per call that keeps it.

**The contract.** After ``serve()`` or a compile, a tower's structure and code are its own: the
graphs were captured from its modules, hooks and code as they were then. Its parameters and
buffers may change *value* in place at any time (``load_state_dict``, an optimizer step outside
the graphs, ``p.mul_(2)``): graphs read them where they live. What gives a weight *new storage*
(``.to()``, ``.half()``, ``load_state_dict(..., assign=True)``, ``p.data = t``, a write to a
module's parameter table as accelerate's ``set_module_tensor_to_device`` does) is seen by
:class:`WeightSlots` before any graph of a call launches, and the graphs are captured again
(``runtime.py``). Anything else (a submodule replaced, a forward hook added, code patched into a
class after the graphs were captured) is the user's to announce with ``refresh()``, which
captures again; hooks and patched code present at capture are found then
(:func:`python_outside_graphs`) and the encoder is served eagerly, where they run.

The check is the one PyTorch's own CUDA graph trees make on static inputs: every weight looked up
where it lives, its address compared with the one captured, in C where the torch build has the
comparison (``_compat.same_data_ptrs``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import nn

from .. import _compat

__all__ = ["WeightSlots", "fingerprint", "python_outside_graphs"]

_data_ptr = torch.Tensor.data_ptr
_version = operator.attrgetter("_version")


class WeightSlots:
    """Every parameter and buffer of ``module``'s tree: the table it lives in and its name, and
    the address it had when the slots were read. A weight that is a wrapper tensor subclass (a
    quantized weight) has no storage of its own; the tensors it holds (``__tensor_flatten__``)
    are what the graphs read, so their addresses are compared for it."""

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
        self._indices = list(range(len(self._addresses)))
        self._wrapped = {i: _held(t) for i, t in enumerate(tensors)
                         if type(t) not in _PLAIN}

    def read(self) -> list[Any]:
        """The tensors in the slots now (``None`` where one was deleted)."""
        return list(map(dict.get, *self._slots))

    def moved(self) -> bool:
        """Whether any weight lives elsewhere than when the slots were read."""
        tensors = self.read()
        try:
            if not _compat.same_data_ptrs(tensors, self._addresses, self._indices):
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
    """Each tensor's address and version counter (-1 for both where a slot holds ``None``): what
    derived copies of weights (the Qwen adapters' padded MLP weights) compare to know whether
    their sources were written or moved since they were made.

    Raises:
        RuntimeError: for an inference tensor, which keeps no version counter.
    """
    try:
        return tuple(map(_data_ptr, tensors)), tuple(map(_version, tensors))
    except (TypeError, AttributeError):  # a projection without a bias: None in its slot
        return (tuple(-1 if t is None else _data_ptr(t) for t in tensors),
                tuple(-1 if t is None else t._version for t in tensors))


def python_outside_graphs(module: nn.Module) -> str | None:
    """Why calls of ``module`` would run Python that a graph captured from its submodules skips,
    or ``None``: a forward hook or pre-hook on a submodule (or a global one), a ``forward`` set
    on a submodule instance, or a class whose ``forward`` was patched in from another module.
    ``module`` itself is left out: its own hooks and forward run around the whole call."""
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
        owner = next((c for c in type(sub).__mro__ if "forward" in vars(c)), None)
        forward = vars(owner).get("forward") if owner is not None else None
        if getattr(forward, "__module__", owner.__module__ if owner else None) != (
                owner.__module__ if owner else None):
            return (f"{name}'s class {owner.__qualname__} runs a forward patched in from "
                    f"{forward.__module__}")
    return None
