"""Test helpers for users' own suites: Hypothesis strategies for specs, budgets and grids.

Needs the ``test`` extra (``pip install vit-graph-backend[test]``), which brings ``hypothesis``.
Nothing else in the package imports this subpackage, so ``import vit_graph_backend`` never imports
``hypothesis``.

Example::

    from hypothesis import given
    from vit_graph_backend.testing import budget_configs, item_spec_lists
"""

from .strategies import (
    budget_configs,
    budget_ladders,
    budget_ranges,
    image_grids,
    item_spec_lists,
    item_specs,
    token_counts,
    vitgraph_options,
)

__all__ = [
    "budget_configs",
    "budget_ladders",
    "budget_ranges",
    "image_grids",
    "item_spec_lists",
    "item_specs",
    "token_counts",
    "vitgraph_options",
]
