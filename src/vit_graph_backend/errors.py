"""The package's exception hierarchy.

Every error the package raises on purpose derives from :class:`VitGraphError`. Errors about bad
user input also derive from the built-in type a caller would expect (``ValueError``,
``TypeError``, ``ImportError``), so ``except ValueError`` keeps working.
"""

from __future__ import annotations

import re

__all__ = ["InvalidInputError", "InvalidOptionError", "MissingDependencyError",
           "UnsupportedGraphError", "UnsupportedModelError", "VitGraphError", "error_line",
           "out_of_memory"]


class VitGraphError(RuntimeError):
    """Base class of every error raised by vit_graph_backend."""


class InvalidOptionError(VitGraphError, ValueError):
    """An option, budget or spec value is out of range; raised when options are built."""


class InvalidInputError(VitGraphError, ValueError):
    """A call input is bad (a tensor's shape or dtype, a ``grid_thw`` row); raised before any
    budget is touched, so a caller's mistake never disables a graph."""


class UnsupportedModelError(VitGraphError, TypeError):
    """No adapter serves this model class (see the protocol docs to write one)."""


class MissingDependencyError(VitGraphError, ImportError):
    """An optional dependency needed by the chosen option is not installed."""


class UnsupportedGraphError(VitGraphError):
    """A traced graph cannot be served by CUDA graphs; callers fall back to eager."""


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says GPU memory ran out (PyTorch's ``OutOfMemoryError``, a plain CUDA
    "out of memory" error, or a cuDNN ``*ALLOC*FAILED`` status). Such a failure belongs to the
    moment's memory, not the shape, so callers try again later. Triton's "out of resources" is
    not one."""
    # by class name: this module stays pure Python
    text = str(exc)
    return (any(cls.__name__ == "OutOfMemoryError" for cls in type(exc).__mro__)
            or "out of memory" in text.lower() or ("ALLOC" in text and "FAILED" in text))


_NEEDED = re.compile(r"[Tt]ried to allocate ([\d.]+ ?[KMGT]?i?B)")
_FREE = re.compile(r"of which ([\d.]+ ?[KMGT]?i?B) (?:is )?free")


def error_line(exc: BaseException) -> str:
    """One short line for a logged failure: out of memory as bytes needed and free, anything
    else as its type and the first line of its message."""
    text = str(exc).strip()
    if out_of_memory(exc):
        parts = [f"{name} {m.group(1)}" for name, m in (("needs", _NEEDED.search(text)),
                                                       ("free", _FREE.search(text))) if m]
        first = text.splitlines()[0][:120] if text else type(exc).__name__
        return f"out of memory ({', '.join(parts) if parts else first})"
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}".rstrip(": ")
