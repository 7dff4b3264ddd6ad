"""The ``vitgraph`` torch.compile backend.

PyTorch registers :data:`vitgraph` from the ``torch_dynamo_backends`` entry point, so nothing is
registered on import (a duplicate name would trip the registry); :func:`register` serves source
trees. A call that raises while Dynamo traces it gets its frame marked skipped for the process,
so the backend remembers compiled frames: a compile requested under one running uncompiled is a
fragment, which runs eagerly and re-arms the frame so its cached graphs serve it again.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .. import _compat
from .background import live_background
from .batched import BatchedGraphEncoder
from .layout import returns_nothing
from ..errors import InvalidOptionError
from ..kernels.fused_linear import CHOICES as FUSED_CHOICES
from ..kernels.fused_linear import fused_epilogue_unavailable
from ..runtime.report import summarize
from ..runtime.inner import compile_inner, inner_compiler_name
from .linear_rewrite import fuse_linear_activations
from ..options import VitGraphOptions
from ..adapters.serve import live_served
from ..cache_dir import use_cache_dir
from .patch_rewrite import patch_embeddings_as_gemm

__all__ = ["VitGraphBackend", "register", "report", "vitgraph", "wait_prepared", "warm"]

log = logging.getLogger(__name__)


class VitGraphBackend:
    """The backend object: compiles graphs, keeps the live encoders for reports and reset."""

    __name__ = "vitgraph"

    def __init__(self) -> None:
        self._encoders: weakref.WeakSet[BatchedGraphEncoder] = weakref.WeakSet()
        #: code objects of the frames compiled into encoders (see the module docstring)
        self._codes: set[types.CodeType] = set()
        self._lock = threading.Lock()
        self.compiles = 0
        #: linear + activation pairs rewritten into one op since reset
        self.fused_linear_activations = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                 options: dict[str, Any] | None = None, mode: str | None = None,
                 **kwargs: Any) -> Any:
        """Compile one Dynamo graph; returns the callable Dynamo runs in its place."""
        if kwargs:
            raise InvalidOptionError(
                f"the vitgraph backend got unexpected arguments {sorted(kwargs)}: pass settings "
                "as torch.compile(..., options={...})")
        opts = VitGraphOptions.from_compile_kwargs(options, mode)
        code = _compat.compiling_code()
        with self._lock:
            skipped = [c for c in _compat.uncompiled_callers() if c in self._codes and c is not code]
        if skipped:
            return _Fragment(gm, skipped)
        if returns_nothing(gm):
            return gm
        if opts.backed_size_oblivious and _compat.enable_backed_size_oblivious():
            log.warning("vitgraph: backed_size_oblivious=True turned on PyTorch's "
                        "torch.fx.experimental._config.backed_size_oblivious for this whole "
                        "process (every later Dynamo compile), so that dynamic graphs serve a "
                        "batch of 1 without another compile")
        inner = inner_compiler_name(example_inputs, opts)
        if opts.patch_embedding == "gemm":  # PyTorch's own ops: any device, any inner compiler
            log.info("vitgraph: patch_embedding='gemm': %d patch convolutions as one GEMM each",
                     patch_embeddings_as_gemm(gm, example_inputs))
        fused = self._fuse_epilogues(gm, example_inputs, opts, inner)
        encoder = BatchedGraphEncoder(gm, example_inputs, opts,
                                      functools.partial(compile_inner, gm, example_inputs, opts),
                                      defer=None if inner == "eager" else self._alone)
        with self._lock:
            self.compiles += 1
            self.fused_linear_activations += fused
            self._encoders.add(encoder)
            if code is not None:
                self._codes.add(code)
        log.info("vitgraph: compiled graph %d (%s, batch axis %s, inner %s%s)", self.compiles,
                 "static" if encoder.static_shape else "dynamic",
                 encoder.layout.batch_symbol, inner,
                 ", at its second call" if encoder.compile_pending else "")
        return encoder

    @staticmethod
    def _fuse_epilogues(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                        opts: VitGraphOptions, inner: str) -> int:
        """``epilogue_fusion="auto"``: rewrite linear + GELU pairs unless the device lacks the
        kernels, TensorRT or gradients rule it out; logs the outcome and returns how many."""
        if opts.epilogue_fusion == "off" or opts.batch_invariant:  # no choice made by timing
            return 0
        why = fused_epilogue_unavailable(next((x.device for x in example_inputs
                                               if isinstance(x, torch.Tensor)), None))
        if why is None and inner == "tensorrt":
            why = "inner_compiler='tensorrt' compiles only PyTorch's own ops"
        if why is None and torch.is_grad_enabled() and any(
                isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs):
            why = "the graph records gradients (the op has no backward)"
        if why is not None:
            log.info("vitgraph: epilogue_fusion='auto' leaves linear layers as they are: %s", why)
            return 0
        count = fuse_linear_activations(gm, example_inputs, rewritten=FUSED_CHOICES.prefetch)
        log.info("vitgraph: epilogue_fusion='auto': %d linear + GELU pairs as one op, each shape "
                 "timed against cuBLAS + a separate activation at its first run", count)
        return count

    def _alone(self, encoder: BatchedGraphEncoder) -> bool:
        """Whether a static graph called again deserves its deferred inner compile: not when a
        live dynamic graph reads the same parameters (serves the same model's other sizes)."""
        with self._lock:
            others = [e for e in self._encoders if e is not encoder]
        return not any(not e.static_shape and e.param_ids & encoder.param_ids for e in others)

    def reset(self) -> None:
        """Free every captured graph, buffer and pool (called by ``torch.compiler.reset()``)."""
        with self._lock:
            encoders = list(self._encoders)
            self._encoders = weakref.WeakSet()
            self._codes = set()
            self.compiles = 0
            self.fused_linear_activations = 0
        for encoder in encoders:
            encoder.clear()

    @property
    def encoders(self) -> list[BatchedGraphEncoder]:
        """The live compiled graphs (each with its graph sets' ``managers``)."""
        with self._lock:
            return list(self._encoders)

    def report(self, served: Sequence[Any] = ()) -> dict[str, Any]:
        """What the live compiled graphs did: ``compiles``, ``fused_linear_activations`` and the
        fields of :func:`vit_graph_backend.report`, totalled with the ``served`` towers."""
        with self._lock:
            encoders = list(self._encoders)
            compiles, fused = self.compiles, self.fused_linear_activations
        compiling = live_background()   # compile_in_background: its eager calls, its thread
        summary = summarize(self.managers(served), [encoder.stats for encoder in encoders]
                            + [model.stats for model in compiling])
        summary["preparing"] += sum(model.preparing for model in compiling)
        return {"compiles": compiles, "fused_linear_activations": fused, **summary}

    def managers(self, served: Sequence[Any] = ()) -> list[Any]:
        """The live compiled graphs' managers (one per graph set), then the ``served`` towers'."""
        return ([m for encoder in self.encoders for m in encoder.managers]
                + [tower.manager for tower in served])


class _Fragment:
    """A fragment of a frame Dynamo skipped (module docstring): runs eagerly, re-arms the frame."""

    def __init__(self, gm: torch.fx.GraphModule, frames: list[types.CodeType]) -> None:
        self.gm, self.frames = gm, frames
        self._rearm()
        log.info("vitgraph: %s ran uncompiled after a call raised while Dynamo traced it; "
                 "its next call is served from its graphs again (this part runs eagerly)",
                 ", ".join(f"{c.co_name} ({c.co_filename}:{c.co_firstlineno})"
                           for c in self.frames))

    def _rearm(self) -> None:
        for code in self.frames:
            _compat.rearm_code(code)

    def __call__(self, *args: Any) -> Any:
        self._rearm()
        return self.gm(*args)


#: The backend instance the entry point names.
vitgraph = VitGraphBackend()


def register() -> bool:
    """Register ``"vitgraph"`` with Dynamo unless it is already known; True if this call did.
    Only needed when the package runs from a source tree without being installed."""
    if "vitgraph" in torch.compiler.list_backends(exclude_tags=()):
        return False
    _compat.register_dynamo_backend("vitgraph", vitgraph)
    return True


def wait_prepared(timeout: float | None = None) -> bool:
    """Wait for every background preparation (``capture="background"``) of this process's
    compiled graphs and served towers, and every ``compile_in_background`` compile, to end;
    True once none runs, False if ``timeout`` seconds passed first. ``report()`` says what they
    left (``graphs_captured``, ``skipped_budgets``)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    left = lambda: None if deadline is None else max(0.0, deadline - time.monotonic())  # noqa: E731
    for model in live_background():   # first: its compile makes managers
        model.wait_compiled(left())
        if model.preparing:
            return False
    for manager in vitgraph.managers(live_served()):
        if not manager.wait_prepared(left()):
            return False
    return True


def warm(model: Callable[..., Any], calls: Iterable[Any], *, cache_dir: Any = None,
         timeout: float | None = None) -> dict[str, Any]:
    """Fill a deployment's cache folder ahead of time: :func:`use_cache_dir` (``cache_dir``,
    else its default folder), every call of ``calls`` through ``model`` (a compiled model or a
    served tower; a call is a tuple of positional arguments, or one argument), without grad,
    then :func:`wait_prepared`. Call it before this process compiles anything; a later process
    that calls ``use_cache_dir`` with the same folder before its first compile finds the
    kernels. Give calls that reach every budget the deployment's stream needs. Returns
    :func:`report` with ``cache_dir``: the folder filled (``None`` where it was refused, after a
    warning naming why). Raises ``TimeoutError`` if a preparation still runs after ``timeout`` s.
    """
    folder = use_cache_dir(cache_dir)
    with torch.no_grad():
        for call in calls:
            if isinstance(call, tuple):
                model(*call)
            else:
                model(call)
    if not wait_prepared(timeout):
        raise TimeoutError(f"vitgraph: graphs still being prepared after timeout={timeout} s")
    return {"cache_dir": None if folder is None else str(folder), **report()}


def report() -> dict[str, Any]:
    """What every compiled graph and served tower of this process did, in one dictionary.

    ``compiles``, ``fused_linear_activations`` (``epilogue_fusion`` rewrites), ``served_towers``
    and, totalled over both, the fields of ``PackedGraphEncoder.report()`` (graphs, graph memory,
    capture time, call counters); the README's ``report()`` section describes them.
    """
    towers = live_served()
    summary = vitgraph.report(towers)
    return {"compiles": summary.pop("compiles"),
            "fused_linear_activations": summary.pop("fused_linear_activations"),
            "served_towers": len(towers), **summary}
