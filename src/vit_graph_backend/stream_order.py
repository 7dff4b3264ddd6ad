"""Stream-ordered use of CUDA graph memory, whichever thread and stream calls.

A graph replay is enqueued on the caller's current stream and returns at once. A host lock alone
therefore does not protect a graph's static buffers or its pool's intermediates: a second caller
on another stream would take the lock as soon as the first call *returned* and rewrite the
buffers while the first replay still ran on the GPU (measured on an H100: 830 of 1200 outputs
wrong with four threads, two of them on side streams; on the packed path the rewritten offsets
made attention read out of bounds and killed the CUDA context).

:class:`StreamOrder` keeps that promise on the GPU as well. Every call's GPU work (input copies,
replays, output copies, eager fallbacks of the same encoder) runs between :meth:`enter` and
:meth:`exit`, under one lock; when the previous call ran on another stream, :meth:`enter`
records an event on that stream and makes the caller's stream wait for it (on one stream the
order is already given and nothing is recorded). No host synchronization: the waits are on the
GPU, and the caller's outputs are made on its own stream, after its own replay, so they are
ready for whatever the caller enqueues next.

There is one order per CUDA device (:func:`order_for`), shared by every manager on it: graphs
share pools (a batched encoder's graph sets, a pool handed to ``capture(graph_pool)``), and one
order for the device covers every way they can. The price is that calls of two different
encoders, made on two streams, run one after the other on the GPU, as they would on one stream.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["StreamOrder", "order_for"]


class StreamOrder:
    """Orders every call that touches graph memory on one device after the previous one.

    Use as ``stream = order.enter()`` ... ``order.exit(stream)`` (``exit`` in a ``finally``), or
    as a context manager. Re-entrant in one thread (a nested call simply keeps the order).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._lock = threading.RLock()
        self._event: Any = None
        self._last_stream: Any = None
        self._depth = 0
        #: how many calls had to wait for another stream's previous call (for tests and reports)
        self.cross_stream_waits = 0

    def enter(self) -> Any:
        """Take the lock and order the current stream after the previous call; returns the
        stream (``None`` off CUDA)."""
        self._lock.acquire()
        self._depth += 1
        if self.device.type != "cuda":
            return None
        stream = torch.cuda.current_stream(self.device)
        last = self._last_stream
        if self._depth == 1 and last is not None and stream.cuda_stream != last.cuda_stream:
            # Recorded now, on the previous call's stream: it marks everything enqueued there so
            # far, the previous call included. Recording lazily keeps one stream's calls free of
            # event work; the price is that the new stream may also wait for work the previous
            # caller enqueued after its call.
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record(last)
            stream.wait_event(self._event)
            self.cross_stream_waits += 1
        return stream

    def exit(self, stream: Any) -> None:
        """Mark ``stream`` as the one holding the last call's GPU work; release the lock."""
        try:
            if stream is not None and self._depth == 1:
                self._last_stream = stream
        finally:
            self._depth -= 1
            self._lock.release()

    def __enter__(self) -> Any:
        return self.enter()

    def __exit__(self, *exc: Any) -> None:
        # the stream is the current one again: a call never leaves a different current stream
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self.exit(stream)


_ORDERS: dict[torch.device, StreamOrder] = {}
_ORDERS_LOCK = threading.Lock()


def order_for(device: torch.device | str) -> StreamOrder:
    """The one :class:`StreamOrder` of ``device`` (``cuda`` is read as the current device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _ORDERS_LOCK:
        order = _ORDERS.get(device)
        if order is None:
            order = _ORDERS[device] = StreamOrder(device)
        return order
