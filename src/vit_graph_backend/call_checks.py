"""`CallChecks`: what a manager looks at for each call, and when.

Besides whether the call needs autograd (graphs serve inference), two kinds of check stand
between a call and its graphs (``runtime.py``):

- **Before a graph launches:** the weights still live where the graphs read them, and every
  submodule is the one they were captured from (``WeightWatch.moved``). A graph launched after
  a weight was given new storage reads memory that may be freed, or handed back to the driver,
  which no later check could undo.
- **After the call's first graph launched**, while the GPU works: nothing inside the model runs
  Python a graph skips (forward hooks, a ``forward`` replaced on an instance or patched into a
  class: ``WeightWatch.hooked``), and the weight copies an encoder keeps for its graphs are
  current (``refresh_encoder_cudagraph_weights``, the Qwen adapters' padded MLP copies). A
  graph launched while one of these fails reads valid memory (the old copies, the old modules,
  which the watch keeps alive) and computes numbers nobody sees: the call then runs eagerly
  (hooks, code), or replays again once the copies are current. A replay normally finds them
  fine, so they cost the GPU no idle time before the graph: on an H100's host, 58 to 96 us
  less to the launch at 256 patches of the Qwen2.5-VL-3B tower, 48 to 298 at 4,096, and 2.7 to
  4.0 % off one small image's latency
  (``benchmarks/results/packed_call_checks_after_the_graph_launch_*``).

The weights that every graph captured since the watch was made reads only through such copies
(``get_encoder_cudagraph_copied_weights``, asked after each capture) are left to the copies'
check after the launch rather than watched before it: copies are never freed while a graph may
read them, and copies that cannot follow in place (``StaleWeightCopiesError``) give the call to
eager and the graphs to a new capture at the next call.

Python that a call runs in this process waits for all of them instead: a capture (which records
what it runs: a hook's or a patched function's effect would be kept in the graph), the forward
over the static buffers without a graph (CPU) and an eager batch, where a hook would fire for a
result thrown away, or twice for one item. A call whose checks fail runs as one eager batch of
all its items, as the model runs a call (``tests/unit/test_call_checks.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import StaleWeightCopiesError
from .replay_io import needs_grad
from .weight_watch import WeightWatch

__all__ = ["CallChecks", "CallState"]

@dataclass
class CallState:
    """One call's standing with its checks.

    Attributes:
        reason: why the call runs eagerly (``None``: graphs serve it).
        looked: whether the checks after launch ran for it (they run once a call).
        stale: whether they found the encoder's weight copies behind and brought them up to
            date, so a graph launched before them read stale ones.
    """

    reason: str | None
    looked: bool = False
    stale: bool = False


class CallChecks:
    """The checks of one manager (see the module docstring).

    Args:
        model: the encoder the graphs run: its optional ``refresh_encoder_cudagraph_weights()``
            brings the weight copies it keeps for its graphs up to date, True if one was copied.
        module: the module whose weights, submodules and hooks are watched; ``None`` for none.
        code: also watch that the module's classes run their libraries' code (``code_watch``).
        log_once: logs a message once per manager.
    """

    def __init__(self, model: Any, module: Any, code: bool,
                 log_once: Callable[[str], None]) -> None:
        self._model, self._module, self._code, self._log_once = model, module, code, log_once
        self._refresh = getattr(model, "refresh_encoder_cudagraph_weights", None)
        self._copied = getattr(model, "get_encoder_cudagraph_copied_weights", None)
        self.watch = WeightWatch.of(module, code)
        #: the weights every graph captured since the watch was made reads through copies only
        #: (``None``: no capture yet), and whether the copies were found unable to follow
        self._skipped: frozenset[tuple[Any, str]] | None = None
        self._copies_stale = False

    def grad(self, inputs: Any) -> str | None:
        """Why ``inputs`` cannot be served from graphs for autograd, else ``None``."""
        if not torch.is_grad_enabled() or not needs_grad(self._model, inputs):
            return None
        # logged once by the eager batch that runs it (runtime.py)
        return "grad required (graphs serve inference; use torch.no_grad())"

    def moved(self) -> bool:
        """Whether a watched weight has other storage, or a submodule is another module, or
        the encoder's weight copies could not follow its weights in place."""
        return self._copies_stale or self.watch is not None and self.watch.moved()

    def captured(self) -> None:
        """After a capture: the watch leaves out the weights that no graph captured since it
        was made reads, only copies of them (the encoder's optional
        ``get_encoder_cudagraph_copied_weights()``: ``(module, name)`` pairs), which
        ``refresh_encoder_cudagraph_weights`` follows after each launch. A graph that reads one
        directly puts it back before it ever replays."""
        if self._copied is None or self.watch is None:
            return
        now = frozenset(self._copied())
        self._skipped = now if self._skipped is None else self._skipped & now
        self.watch.skip(self._skipped)

    def follow(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """After :meth:`moved`, watch the module as it is now; ``None`` if its weights are
        still on the graphs' ``device`` and ``dtype`` (they can be captured again), else why the
        graphs cannot serve them."""
        watch, self.watch = self.watch, WeightWatch.of(self._module, self._code)
        self._skipped, self._copies_stale = None, False
        param = watch.param() if watch is not None else None
        place = (None, None) if param is None else (param.device, param.dtype)
        added = watch.devices_added() if watch is not None else set()
        if place == (device, dtype) and not added:
            return None
        where = (f"some of them to {', '.join(sorted(map(str, added)))}" if added
                 else f"to {place[0]}, {place[1]}")
        return (f"the encoder's parameters moved {where} after graphs were captured for "
                f"{device}, {dtype}; build it again (serve() or a new manager) to have graphs "
                "there")

    def look(self, call: CallState) -> str | None:
        """The checks that need not come before a launch, once per call: hooks or patched code
        (the call's new ``reason``), else the weight copies brought up to date (``stale``)."""
        if call.looked:
            return call.reason
        call.looked = True
        # the tables were read by moved() in this call
        hooked = self.watch.hooked(refresh=False) if self.watch is not None else None
        if hooked is not None:
            call.reason = f"{hooked}, which graphs do not run"
            self._log_once("vitgraph: " + call.reason + "; running eagerly")
        elif self._refresh is not None:
            try:
                call.stale = bool(self._refresh())
            except StaleWeightCopiesError as exc:  # the graphs' copies stay valid memory
                call.reason = f"the encoder's weight copies cannot follow its weights: {exc}"
                self._log_once("vitgraph: " + call.reason + "; its graphs are captured again")
                self._copies_stale = True   # moved(): the next call captures again
        return call.reason
