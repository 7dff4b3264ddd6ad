"""A vision encoder's repeated layers as nested compile regions: compiled once for all of them.

An encoder is one layer class stacked 12 to 32 times (timm's ``Block``, HF's ``CLIPEncoderLayer``).
``torch.compile`` compiles every copy. Marked with ``torch.compiler.nested_compile_region``, the
copies are called as one layer graph, which Inductor compiles once and ``epilogue_fusion``
rewrites once (``linear_rewrite.py``): a cold first pass of CLIP ViT-L/14-336 takes 29 % less.
Dynamo still traces each copy (torch 2.11, measured), so a warm pass gains nothing
(``docs/performance.md``, first pass). Outside a compile a region runs its function unchanged.
"""

from __future__ import annotations

import copyreg
import logging
from typing import Any

from torch import nn

from .. import _compat
from ..runtime.weights import DISPATCHES_TO_BASE

__all__ = ["mark_layer_regions"]

log = logging.getLogger(__name__)

#: Traces of one region Dynamo may keep in one graph. A layer whose trace cannot be reused (it
#: reads a value of its own, such as its index) is traced per copy, as if unmarked: the bound is
#: above any stack's depth so that such a layer is never refused (PyTorch's default is 8).
_MAX_TRACES = 4096

#: base class -> its marked subclass, made once per class
_MARKED: dict[type, type] = {}


def mark_layer_regions(model: nn.Module) -> int:
    """Mark ``model``'s repeated layers as nested compile regions; returns how many were marked.

    A stack of repeated layers is an ``nn.ModuleList`` or ``nn.Sequential`` of two or more
    children of one class defined outside ``torch.nn``; the outermost stacks are marked, not the
    stacks inside their layers. Each layer of a stack changes class to a subclass of its own
    whose ``forward`` runs the class's ``forward`` as a region: only these instances change, and
    eager calls run the same code (a ``forward`` patched into the class later too). Call it
    before ``torch.compile``; layers already marked (by this function or by
    ``nested_compile_region`` on their class) are left as they are, so a second call returns 0.
    A pickled or copied layer comes back unmarked. For ``torch.compile``; ``serve()`` captures
    eagerly and gains nothing from regions.
    """
    marked = 0
    inside: list[str] = []   # the stacks found: what lies within them is left
    for name, module in model.named_modules():
        if any(not outer or name.startswith(f"{outer}.") for outer in inside):
            continue
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        classes = {type(layer) for layer in module}
        if len(classes) != 1:
            continue
        cls = classes.pop()
        if cls.__module__.split(".")[0] == "torch":   # nn.Linear stacks and the like
            continue
        inside.append(name)
        if DISPATCHES_TO_BASE in vars(cls) or _compat.region_body(cls.forward) is not cls.forward:
            continue   # marked already, here or on the class
        subclass = _marked(cls)
        for layer in module:
            layer.__class__ = subclass
        marked += len(module)
        log.info("vitgraph: %s: %d layers of %s marked as nested compile regions",
                 name or type(model).__name__, len(module), cls.__qualname__)
    return marked


def _marked(cls: type) -> type:
    """``cls`` with a ``forward`` that runs ``cls.forward`` as a region, read at each call (a
    forward patched into ``cls`` later runs), under ``cls``'s name and module; it names itself a
    dispatcher, so ``runtime/weights.python_outside_graphs`` checks ``cls``'s code, not its own."""
    subclass = _MARKED.get(cls)
    if subclass is None:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return cls.forward(self, *args, **kwargs)

        subclass = type(cls.__name__, (cls,), {
            "forward": _compat.nested_region(forward, _MAX_TRACES),
            DISPATCHES_TO_BASE: True, "__reduce_ex__": _reduce_unmarked,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__})
        _MARKED[cls] = subclass
    return subclass


def _reduce_unmarked(self: nn.Module, protocol: Any) -> Any:
    """Pickle and copy a marked layer as its base class: the subclass is made at run time and
    cannot be found by name when loading, and a loader need not have this package."""
    return copyreg._reconstructor, (type(self).__mro__[1], object, None), self.__getstate__()
