"""The package's exception hierarchy.

Every error the package raises on purpose derives from :class:`VitGraphError`, so callers can catch
one type. Errors about bad user input also derive from the built-in type a caller would expect
(``ValueError``, ``TypeError``, ``ImportError``), the way Hypothesis's ``InvalidArgument`` also is a
``TypeError``: ``except ValueError`` keeps working for code that does not know this package.
"""

from __future__ import annotations

__all__ = [
    "CaptureError",
    "InvalidInputError",
    "InvalidOptionError",
    "MissingDependencyError",
    "UnsupportedGraphError",
    "UnsupportedModelError",
    "VitGraphError",
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


class CaptureError(VitGraphError):
    """Deprecated, never raised: a failed capture falls back to eager, logged and reported in
    ``report()["skipped_budgets"]``. Goes in the next release."""
