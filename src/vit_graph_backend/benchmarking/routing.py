"""Deprecated: the plan preview moved beside the planner, to :mod:`vit_graph_backend.plan_preview`.

Kept one release so that imports of the first release's name keep working, with a warning.
"""

import warnings

from ..plan_preview import *  # noqa: F403
from ..plan_preview import __all__  # noqa: F401

warnings.warn("vit_graph_backend.benchmarking.routing is deprecated: use "
              "vit_graph_backend.plan_preview", DeprecationWarning, stacklevel=2)
