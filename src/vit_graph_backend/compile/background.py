"""``torch.compile(backend="vitgraph")`` with its first pass on a thread, eager answering meanwhile.

Under ``torch.compile`` the first call holds Dynamo's trace, the backend and the captures: 1.7 to
7.5 s on one H200 (``docs/performance.md``, first call), which ``capture="background"`` cannot
move because Dynamo traces before any backend runs. :func:`compile_in_background` answers each
call with the model's own forward until a thread has run the first call's inputs through the
compiled model (Dynamo, Inductor, every budget's capture); later calls run compiled. The model is
batch-first: tensor arguments whose leading size is the first tensor's are the batch. The thread
traces that axis as dynamic (a first batch of one repeated to two), so that every batch size
after the switch finds its graph, then a batch of one, which Dynamo traces apart; batches of one
are answered eagerly until then. It compiles under the first call's grad, inference, autocast,
device and stream. Outputs before the switch are eager's, after it the graphs', which differ as
the graph path differs from eager; ``batch_invariant=True`` refuses the switch.

While the thread traces, Dynamo holds PyTorch's default random generators (CPU, and the current
CUDA device's) and puts back their state when its trace ends, so numbers other threads draw from
them meanwhile are drawn again afterwards; while it captures, CUDA refuses a device-wide
synchronize and random numbers on the device from other threads. The calls it answers are kept
apart from its captures (``runtime/capture.py``'s gate); other work that samples draws from its
own ``torch.Generator`` or waits for ``wait_prepared()``. After ``torch.compiler.reset()`` the
next call compiles on the caller's thread, as ``torch.compile``'s would.
"""

from __future__ import annotations

import atexit
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


@atexit.register
def _no_capture_cut_at_exit() -> None:
    """The interpreter's exit waits for a capture in progress and lets no other begin: a thread
    stopped inside a stream capture can crash the exit (``runtime/manager.py`` does the same
    for its background preparations)."""
    if any(model.preparing for model in live_background()):
        beside_captures().__enter__()   # held until the process ends


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
    """What :func:`compile_in_background` returns: call it as the model (its attributes are the
    model's; its ``state_dict`` the model's under ``model.``). ``failure``: why the compile
    failed (every call then runs eagerly), ``failure_one``: why a batch of one's did (those run
    eagerly), else ``None``; ``compile_seconds``: the thread's time from the first call to the
    switch, once made."""

    def __init__(self, model: nn.Module, options: dict[str, Any]) -> None:
        super().__init__()
        from .backend import vitgraph

        self.model = model
        # not a submodule: its parameters are the model's, listed once
        self.__dict__["compiled"] = torch.compile(model, backend=vitgraph, options=options)
        self.stats = GraphStats()   # the calls answered eagerly while compiling
        self.failure: str | None = None
        self.failure_one: str | None = None
        self.compile_seconds: float | None = None
        self._ready = False       # batches of two or more run compiled
        self._ready_one = False   # and batches of one
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        with _live_lock:
            _live.add(self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._ready_one and not self.preparing:   # every batch size compiled: nothing to look at
            return self.compiled(*args, **kwargs)
        batch = _batch_size(args, kwargs)
        if self._ready and (batch != 1 or self._ready_one):
            if not self.preparing:
                return self.compiled(*args, **kwargs)
            with beside_captures():   # the thread still captures a batch of one's graphs
                return self.compiled(*args, **kwargs)
        reason = self.failure or (self.failure_one if self._ready else None) or COMPILING
        with beside_captures():   # never while the thread captures (runtime/capture.py's gate)
            out = self.model(*args, **kwargs)   # a bad request raises here, before any compile
        self.stats.record_call()
        self.stats.record_eager(batch or 1, reason)
        if self._thread is None and self.failure is None and batch != 0:   # 0: nothing to trace
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
        if a compile failed (``failure``, ``failure_one``), the thread is still running after
        ``timeout`` s, or no call has started it."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        return self._ready and self._ready_one and not self.preparing

    def _start(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        thread = threading.Thread(target=self._compile, args=(args, kwargs, _caller_state()),
                                  name="vitgraph-compile", daemon=True)
        self._thread = thread   # before it runs: what it runs may ask whether it is the thread
        try:
            thread.start()
        except RuntimeError as exc:   # no thread to start (the interpreter is exiting)
            self.failure = f"could not start its thread ({error_line(exc)})"

    def _compile(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 state: list[contextlib.AbstractContextManager[Any]]) -> None:
        start = time.perf_counter()
        batch = _batch_size(args, kwargs)
        with contextlib.ExitStack() as stack:
            for context in state:
                stack.enter_context(context)
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
                self.failure_one = f"compiling a batch of one failed: {error_line(exc)}"
                log.warning("vitgraph: %s; batches of one run the model eagerly",
                            self.failure_one)
                return
            self._ready_one = True

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("a compile_in_background model cannot be pickled or copied (its thread "
                        "and compiled frames belong to this process): copy or save its .model")

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:   # the model's own attributes, as torch.compile's wrapper gives
            return getattr(self.model, name)


def _caller_state() -> list[contextlib.AbstractContextManager[Any]]:
    """The calling thread's grad, inference and autocast modes, CUDA device and stream, as
    contexts the compiling thread enters: Dynamo guards on them, so a compile under others
    would not serve the caller's calls."""
    state: list[contextlib.AbstractContextManager[Any]] = [
        torch.inference_mode(torch.is_inference_mode_enabled()),
        torch.set_grad_enabled(torch.is_grad_enabled())]
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            state.append(torch.autocast(device, dtype=torch.get_autocast_dtype(device)))
    if torch.cuda.is_initialized():
        state += [torch.cuda.device(torch.cuda.current_device()),
                  torch.cuda.stream(torch.cuda.current_stream())]
    return state


def _batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The first tensor argument's leading size: the batch axis the backend serves."""
    first = next((a for a in (*args, *kwargs.values())
                  if isinstance(a, torch.Tensor) and a.dim()), None)
    return None if first is None else first.shape[0]


def _batched(value: Any, batch: int | None) -> bool:
    """Whether ``value`` is a tensor of the call's batch (its leading size is ``batch``)."""
    return isinstance(value, torch.Tensor) and bool(value.dim()) and value.shape[0] == batch


def _first(value: Any, batch: int) -> Any:
    """A tensor of the call's batch cut to its first row; anything else as it is."""
    return value[:1] if _batched(value, batch) else value


def _dynamic(value: Any, batch: int | None) -> Any:
    """A tensor of the call's batch as a new tensor over the same rows (a batch of one repeated
    to two), its batch axis marked dynamic for Dynamo; anything else as it is."""
    if not _batched(value, batch):
        return value
    alias = value.repeat(2, *([1] * (value.dim() - 1))) if batch == 1 else value.view(value.shape)
    _compat.maybe_mark_dynamic(alias, 0)
    return alias
