"""The modes ``vitgraph bench`` compares, each a way to run the same model on the same stream.

- ``eager``: the model as is; ``compile-default``: ``torch.compile(model)``;
  ``reduce-overhead``: ``torch.compile(model, mode="reduce-overhead")``.
- ``vitgraph``: the defaults (batched: ``torch.compile(model, backend=vitgraph, options=...)``;
  packed: ``serve(tower, **options)``); ``vitgraph-eager``: ``inner_compiler="eager"``.
- Not in the default list, each ``vitgraph`` with one option (:data:`VITGRAPH_MODES`):
  ``vitgraph-inductor``, ``vitgraph-epilogue-off``, ``vitgraph-batch-invariant``,
  ``vitgraph-torch-launch``, ``vitgraph-patch-conv`` (batched models), ``vitgraph-background``;
  ``vitgraph-compile-background``: ``compile_in_background`` (``compile/background.py``; batched
  models; a served tower's first call holds no Dynamo trace: ``vitgraph-background``).

Packed towers go through :func:`vit_graph_backend.adapters.serve.serve`: Dynamo skips the router
frame, so ``torch.compile`` options could not reach it. The backend object is passed directly, so
a broken entry point cannot hide behind a name lookup. Any failure propagates to the runner,
which reports the mode as failed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_MODES", "MODES", "VITGRAPH_MODES", "PreparedMode", "backend_report",
           "prepare_mode", "reset"]

#: The modes a GPU run compares when none are named.
DEFAULT_MODES: tuple[str, ...] = ("eager", "compile-default", "reduce-overhead", "vitgraph",
                                  "vitgraph-eager")
#: Every mode ``--modes`` accepts.
MODES: tuple[str, ...] = (*DEFAULT_MODES, "vitgraph-inductor",
                          "vitgraph-epilogue-off", "vitgraph-batch-invariant",
                          "vitgraph-torch-launch", "vitgraph-patch-conv", "vitgraph-background",
                          "vitgraph-compile-background")

#: The vitgraph modes and the backend options each one adds.
VITGRAPH_MODES: dict[str, dict[str, Any]] = {
    "vitgraph": {},
    "vitgraph-eager": {"inner_compiler": "eager"},
    "vitgraph-inductor": {"inner_compiler": "inductor"},
    "vitgraph-epilogue-off": {"epilogue_fusion": "off"},
    "vitgraph-batch-invariant": {"batch_invariant": True},
    "vitgraph-torch-launch": {"graph_launch": "torch"},
    "vitgraph-patch-conv": {"patch_embedding": "conv"},
    "vitgraph-background": {"capture": "background"},
    "vitgraph-compile-background": {},   # batched: compile_in_background (prepare_mode)
}


@dataclass
class PreparedMode:
    """A mode ready to run: ``fn(*inputs)``; vitgraph modes add a report and a cleanup."""

    name: str
    fn: Callable[..., Any]
    report: Callable[[], dict[str, Any]] | None = None
    cleanup: Callable[[], None] | None = None
    options: dict[str, Any] | None = None
    #: waits for a background preparation (``capture="background"``) to be served
    wait: Callable[[], bool] | None = None


def prepare_mode(name: str, built: Any, vitgraph_options: Mapping[str, Any]) -> PreparedMode:
    """Build mode ``name`` (one of :data:`MODES`) around ``built`` (a
    :class:`~.models.BuiltModel`); ``vitgraph_options`` are the backend options the vitgraph
    modes share (budgets, policy, ...), to which each adds its own (:data:`VITGRAPH_MODES`).

    Raises:
        ValueError: for an unknown mode. Anything else (missing backend or adapter) propagates.
    """
    import torch

    if name == "eager":
        return PreparedMode(name, built.module)
    if name == "compile-default":
        return PreparedMode(name, torch.compile(built.module))
    if name == "reduce-overhead":
        return PreparedMode(name, torch.compile(built.module, mode="reduce-overhead"))
    if name not in VITGRAPH_MODES:
        raise ValueError(f"mode={name!r} is invalid: choose from {', '.join(MODES)}")
    options = {**vitgraph_options, **VITGRAPH_MODES[name]}
    if built.entry.packed:
        from ..adapters.serve import serve

        served = serve(built.module, **options)
        # the report shaped like vitgraph.report(): a served tower has no Dynamo compiles
        return PreparedMode(name, served, lambda: {"compiles": None, **served.report()},
                            served.manager.clear, options, served.wait_prepared)
    from ..compile.backend import vitgraph as backend
    from ..compile.backend import wait_prepared

    if name == "vitgraph-compile-background":
        from ..compile.background import compile_in_background

        fn = compile_in_background(built.module, options)
    else:
        fn = torch.compile(built.module, backend=backend, options=options)
    return PreparedMode(name, fn, backend.report, backend.reset, options, wait_prepared)


def backend_report(mode: PreparedMode) -> dict[str, Any] | None:
    """The vitgraph counters after a vitgraph mode ran, or ``None`` for the other modes."""
    return None if mode.report is None else dict(mode.report())


def reset(mode: PreparedMode | None = None) -> None:
    """Free compiled frames and captured graphs between modes (and run the mode's cleanup)."""
    import gc

    import torch

    torch.compiler.reset()
    if mode is not None and mode.cleanup is not None:
        mode.cleanup()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
