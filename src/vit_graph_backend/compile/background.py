"""``torch.compile(backend="vitgraph")`` with its first pass on a thread, eager answering meanwhile.

Under ``torch.compile`` the first call holds Dynamo's trace, the backend and the captures: 1.8 to
7 s on one H200 (``docs/performance.md``, first call), which ``capture="background"`` cannot move
because Dynamo traces before any backend runs. :func:`compile_in_background` answers each call
with the model's own forward until a thread has run the first call's inputs through the compiled
model (Dynamo, Inductor, every budget's capture); later calls run compiled. The thread traces
the batch axis as dynamic (a first batch of one repeated to two), so that every batch size after
the switch finds its graph, then a batch of one, which Dynamo traces apart; batches of one are
answered eagerly until that trace is done. Outputs before the switch are eager's, after it the
graphs', which differ as the graph path differs from eager; ``batch_invariant=True`` refuses it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .. import _compat
from ..errors import InvalidOptionError, error_line
from ..options import VitGraphOptions
from ..runtime.capture import beside_captures
from ..stats import GraphStats

__all__ = ["BackgroundCompiled", "COMPILING", "compile_in_background", "live_background"]

log = logging.getLogger(__name__)

#: The reason counted for a call answered eagerly while the thread compiles.
COMPILING = "compiling in the background (compile_in_background)"

_live: weakref.WeakSet[BackgroundCompiled] = weakref.WeakSet()
_live_lock = threading.Lock()


def live_background() -> list[BackgroundCompiled]:
    """The models of :func:`compile_in_background` still alive (for ``report()``)."""
    with _live_lock:
        return list(_live)


def compile_in_background(model: nn.Module,
                          options: Mapping[str, Any] | None = None) -> BackgroundCompiled:
    """``model`` compiled with ``torch.compile(model, backend="vitgraph", options=options)``,
    its first call answered at once: see the module docstring.

    Raises:
        InvalidOptionError: a bad option (as ``torch.compile`` would at its first call), or
            ``batch_invariant=True``, whose outputs the switch from eager would change.
    """
    opts = VitGraphOptions.from_compile_kwargs(options)
    if opts.batch_invariant:
        raise InvalidOptionError(
            "batch_invariant=True is invalid with compile_in_background: the calls answered "
            "eagerly before the switch and by the graphs after it differ; use torch.compile")
    return BackgroundCompiled(model, dict(options or {}))


class BackgroundCompiled(nn.Module):
    """What :func:`compile_in_background` returns: call it as the model. ``failure``: why the
    compile failed (calls then go on eagerly), else ``None``; ``compile_seconds``: the thread's
    time from the first call to the switch, once made."""

    def __init__(self, model: nn.Module, options: dict[str, Any]) -> None:
        super().__init__()
        from .backend import vitgraph

        self.model = model
        # not a submodule: its parameters are the model's, listed once
        self.__dict__["compiled"] = torch.compile(model, backend=vitgraph, options=options)
        self.stats = GraphStats()   # the calls answered eagerly while compiling
        self.failure: str | None = None
        self.compile_seconds: float | None = None
        self._ready = False   # batches of two or more run compiled
        self._ready_one: bool | str = False   # a batch of one: True, or why it cannot
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        with _live_lock:
            _live.add(self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        batch = _batch_size(args, kwargs)
        if self._ready and (batch != 1 or self._ready_one is True):
            return self.compiled(*args, **kwargs)
        with beside_captures():   # never while the thread captures (runtime/capture.py's gate)
            out = self.model(*args, **kwargs)   # a bad request raises here, before any compile
        self.stats.record_call()
        self.stats.record_eager(batch or 1, self.failure or self._ready_one or COMPILING)
        if self._thread is None and self.failure is None:
            with self._start_lock:
                if self._thread is None:
                    self._start(args, kwargs)
        return out

    @property
    def preparing(self) -> bool:
        """Whether the thread still compiles."""
        return self._thread is not None and self._thread.is_alive()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; True once calls of every batch size run compiled, False
        if it failed (``failure``), is still running after ``timeout`` s or never started."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        return self._ready and self._ready_one is True and not self.preparing

    def _start(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                 torch.cuda.current_device() if torch.cuda.is_initialized() else None)
        thread = threading.Thread(target=self._compile, args=(args, kwargs, state),
                                  name="vitgraph-compile", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:   # no thread to start (the interpreter is exiting)
            self.failure = f"could not start its thread ({error_line(exc)})"
            return
        self._thread = thread

    def _compile(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 state: tuple[bool, bool, int | None]) -> None:
        grad, inference, device = state
        start = time.perf_counter()
        batch = _batch_size(args, kwargs)
        with (torch.inference_mode(inference), torch.set_grad_enabled(grad),
              torch.cuda.device(device) if device is not None else contextlib.nullcontext()):
            try:
                self.compiled(*[_dynamic(a, batch) for a in args],
                              **{k: _dynamic(v, batch) for k, v in kwargs.items()})
            except Exception as exc:   # calls go on eagerly, with the reason
                self.failure = f"compiling in the background failed: {error_line(exc)}"
                log.warning("vitgraph: %s; calls run the model eagerly", self.failure)
                return
            self.compile_seconds = time.perf_counter() - start
            self._ready = True
            log.info("vitgraph: compiled in the background in %.2f s; calls now run compiled "
                     "(batches of one once traced)", self.compile_seconds)
            try:
                if batch is not None:
                    self.compiled(*[_first(a, batch) for a in args],
                                  **{k: _first(v, batch) for k, v in kwargs.items()})
            except Exception as exc:
                self._ready_one = f"compiling a batch of one failed: {error_line(exc)}"
                log.warning("vitgraph: %s; batches of one run the model eagerly",
                            self._ready_one)
                return
            self._ready_one = True

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own, under its own keys."""
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Into the model, under its own keys."""
        return self.model.load_state_dict(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:   # the model's own attributes, as torch.compile's wrapper gives
            return getattr(self.model, name)


def _batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The first tensor argument's leading size: the batch axis the backend serves."""
    first = next((a for a in (*args, *kwargs.values())
                  if isinstance(a, torch.Tensor) and a.dim()), None)
    return None if first is None else first.shape[0]


def _first(value: Any, batch: int) -> Any:
    """A tensor of the call's batch cut to its first row; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
        return value[:1]
    return value


def _dynamic(value: Any, batch: int | None) -> Any:
    """A tensor of the call's batch as a new tensor over the same rows (a batch of one repeated
    to two), its batch axis marked dynamic for Dynamo; anything else as it is."""
    if not isinstance(value, torch.Tensor) or not value.dim() or value.shape[0] != batch:
        return value
    alias = value.repeat(2, *([1] * (value.dim() - 1))) if batch == 1 else value.view(value.shape)
    _compat.maybe_mark_dynamic(alias, 0)
    return alias
