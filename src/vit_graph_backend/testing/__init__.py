"""Test helpers for users' own suites: Hypothesis strategies for specs, budgets and grids.

Needs the ``test`` extra (``pip install vit-graph-backend[test]``). Nothing else in the package
imports this subpackage, so ``import vit_graph_backend`` never imports ``hypothesis``.
"""

from .strategies import *  # noqa: F403  (the names listed in strategies.__all__)
from .strategies import __all__ as __all__
