"""Test helpers for users' own suites: Hypothesis strategies for specs, budgets and grids, and
:func:`check_adapter`, the conformance check of a packed tower's adapter (``conformance``).

Needs the ``test`` extra (``pip install vit-graph-backend[test]``). Nothing else in the package
imports this subpackage, so ``import vit_graph_backend`` never imports ``hypothesis``.
"""

from .strategies import *  # noqa: F403  (the names listed in strategies.__all__)
from .strategies import __all__ as _strategies
from .conformance import AdapterCheckError, check_adapter

__all__ = sorted([*_strategies, "AdapterCheckError", "check_adapter"])
