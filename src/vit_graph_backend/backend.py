"""The ``vitgraph`` torch.compile backend.

``torch.compile(model, backend="vitgraph")`` finds :data:`vitgraph` through the
``torch_dynamo_backends`` entry point (see ``pyproject.toml``); PyTorch registers it itself when it
loads the entry point, so this module never calls ``register_backend`` on import (a second
registration of the name would trip the registry's duplicate-name assertion). For an environment
where the package is on ``sys.path`` but not installed, :func:`register` registers it once,
guarded. Passing the object directly, ``torch.compile(model, backend=vitgraph)``, always works.

Dynamo calls the backend as ``backend(gm, example_inputs, **kwargs)``; ``options=`` arrives only
when non-empty and ``mode=`` only when not the default. Both are validated into a
:class:`~vit_graph_backend.options.VitGraphOptions` here, at compile time.

``torch.compiler.reset()`` calls :meth:`VitGraphBackend.reset`, which frees every captured graph.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .batched import BatchedGraphEncoder
from .errors import InvalidOptionError
from .inner import compile_inner
from .options import VitGraphOptions
from .stats import GraphStats

__all__ = ["VitGraphBackend", "register", "vitgraph"]

log = logging.getLogger(__name__)


class VitGraphBackend:
    """The backend object: compiles graphs, keeps the live encoders for reports and reset."""

    __name__ = "vitgraph"

    def __init__(self) -> None:
        self._encoders: weakref.WeakSet[BatchedGraphEncoder] = weakref.WeakSet()
        self._lock = threading.Lock()
        self.compiles = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                 options: dict[str, Any] | None = None, mode: str | None = None,
                 **kwargs: Any) -> Any:
        """Compile one Dynamo graph; returns the callable Dynamo runs in its place."""
        if kwargs:
            raise InvalidOptionError(
                f"the vitgraph backend got unexpected arguments {sorted(kwargs)}: pass settings "
                "as torch.compile(..., options={...})")
        opts = VitGraphOptions.from_compile_kwargs(options, mode)
        fn = compile_inner(gm, example_inputs, opts)
        encoder = BatchedGraphEncoder(gm, example_inputs, opts, fn)
        with self._lock:
            self.compiles += 1
            self._encoders.add(encoder)
        log.info("vitgraph: compiled graph %d (%s, batch axis %s, inner %s)", self.compiles,
                 "static" if encoder.static_shape else "dynamic",
                 encoder.layout.batch_symbol, opts.inner_compiler)
        return encoder

    def reset(self) -> None:
        """Free every captured graph, buffer and pool (called by ``torch.compiler.reset()``)."""
        with self._lock:
            encoders = list(self._encoders)
            self._encoders = weakref.WeakSet()
            self.compiles = 0
        for encoder in encoders:
            encoder.clear()

    @property
    def encoders(self) -> list[BatchedGraphEncoder]:
        """The live compiled graphs (each with its graph sets' ``managers``)."""
        with self._lock:
            return list(self._encoders)

    def report(self) -> dict[str, Any]:
        """Totals over the live compiled graphs: compiles, graphs, memory, capture time, stats."""
        with self._lock:
            encoders = list(self._encoders)
            compiles = self.compiles
        stats = GraphStats()
        graphs = memory = 0
        seconds = 0.0
        for encoder in encoders:
            stats.merge(encoder.stats)
            for manager in encoder.managers:
                stats.merge(manager.stats)
                report = manager.memory_report()
                graphs += report["graphs"]
                memory += report["total_bytes"]
                seconds += report["capture_seconds"]
        return {"compiles": compiles, "graphs_captured": graphs, "graph_memory_bytes": memory,
                "capture_seconds": round(seconds, 4), "stats": stats.as_dict()}


#: The backend instance the entry point names.
vitgraph = VitGraphBackend()


def register() -> bool:
    """Register ``"vitgraph"`` with Dynamo unless it is already known (installed entry point or an
    earlier call). Returns True if this call registered it. Only needed when the package is used
    from a source tree without being installed."""
    if "vitgraph" in torch.compiler.list_backends(exclude_tags=()):
        return False
    from . import _compat

    _compat.register_dynamo_backend("vitgraph", vitgraph)
    return True
