"""The package's exception hierarchy.

Every error the package raises on purpose derives from :class:`VitGraphError`, so callers can catch
one type. Errors about bad user input also derive from the built-in type a caller would expect
(``ValueError``, ``TypeError``, ``ImportError``), the way Hypothesis's ``InvalidArgument`` also is a
``TypeError``: ``except ValueError`` keeps working for code that does not know this package.
"""

from __future__ import annotations

import re

__all__ = [
    "InvalidInputError",
    "InvalidOptionError",
    "MissingDependencyError",
    "UnsupportedGraphError",
    "UnsupportedModelError",
    "VitGraphError",
    "error_line",
    "out_of_memory",
]


class VitGraphError(RuntimeError):
    """Base class of every error raised by vit_graph_backend."""


class InvalidOptionError(VitGraphError, ValueError):
    """An option, budget or spec value is out of range; raised when options are built."""


class InvalidInputError(VitGraphError, ValueError):
    """A call input is bad (a tensor's shape or dtype, a ``grid_thw`` row); raised before any
    budget is touched, so a caller's mistake never disables a graph.

    Kept apart from :class:`InvalidOptionError`: an option is wrong once, when options are built;
    an input is wrong per call, and the serving path must tell the two apart.
    """


class UnsupportedModelError(VitGraphError, TypeError):
    """No adapter serves this model class (see the protocol docs to write one)."""


class MissingDependencyError(VitGraphError, ImportError):
    """An optional dependency needed by the chosen option is not installed."""


class UnsupportedGraphError(VitGraphError):
    """A traced graph cannot be served by CUDA graphs; callers fall back to eager."""


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says GPU memory ran out: PyTorch's ``OutOfMemoryError``, a CUDA error of
    a failed allocation raised as a plain ``RuntimeError`` ("CUDA error: out of memory", from
    a library's own allocation), or a cuDNN status of one in the frontend's message
    (``CUDNN_STATUS_ALLOC_FAILED`` before cuDNN 9,
    ``CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED`` and its host twin in 9). Such a
    failure belongs to the moment's memory, not to the shape or the kernel: callers try again
    later instead of refusing for good. Triton's "out of resources" (shared memory, registers)
    is not one."""
    # by class name: this module stays pure Python (tests/unit/test_architecture.py)
    text = str(exc)
    return (any(cls.__name__ == "OutOfMemoryError" for cls in type(exc).__mro__)
            or "out of memory" in text.lower() or ("ALLOC" in text and "FAILED" in text))


_NEEDED = re.compile(r"[Tt]ried to allocate ([\d.]+ ?[KMGT]?i?B)")
_FREE = re.compile(r"of which ([\d.]+ ?[KMGT]?i?B) (?:is )?free")


def error_line(exc: BaseException) -> str:
    """One short line for a failure that is logged and recorded, not raised: an out-of-memory
    error as the bytes it asked for and the bytes free (PyTorch's message runs to several
    sentences of advice), anything else as its type and the first line of its message."""
    text = str(exc).strip()
    if out_of_memory(exc):
        parts = [f"{name} {m.group(1)}" for name, m in (("needs", _NEEDED.search(text)),
                                                       ("free", _FREE.search(text))) if m]
        first = text.splitlines()[0][:120] if text else type(exc).__name__
        return f"out of memory ({', '.join(parts) if parts else first})"
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}".rstrip(": ")

