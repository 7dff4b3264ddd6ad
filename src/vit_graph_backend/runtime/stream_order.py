"""Stream-ordered use of CUDA graph memory, whichever thread and stream calls.

A replay is enqueued on the caller's stream and returns at once, so a host lock alone does not
protect static buffers: a caller on another stream could rewrite them while the previous replay
still runs. :class:`StreamOrder` runs every call's GPU work between :meth:`~StreamOrder.enter` and
:meth:`~StreamOrder.exit` under one lock; when the previous call ran on another stream, the
caller's stream waits on an event recorded there (on the GPU, no host sync). There is one order
per device (:func:`order_for`), shared by every manager, since graphs may share pools; calls of
two encoders on two streams therefore serialize on the GPU.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .._compat import current_raw_stream

__all__ = ["StreamOrder", "order_for"]

#: Stream objects an order keeps by raw handle (PyTorch's stream pools hold 32 per priority).
_STREAMS_KEPT = 64


class StreamOrder:
    """Orders every call that touches graph memory on one device after the previous one: use
    ``stream = order.enter()`` ... ``order.exit(stream)`` (``exit`` in a ``finally``), or as a
    context manager. Re-entrant in one thread (a nested call keeps the order)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._lock = threading.RLock()
        self._index = self.device.index  # None: the current device ("cuda")
        self._event: Any = None
        self._last_stream: Any = None  # a torch.cuda.Stream
        self._last_raw: int | None = None  # its raw handle
        self._streams: dict[int, Any] = {}  # stream objects by raw handle
        self._raw: Any = None  # the context manager's enter, for its exit
        self._depth = 0
        #: calls that had to wait for another stream's previous call
        self.cross_stream_waits = 0

    def enter(self) -> Any:
        """Take the lock and order the current stream after the previous call; returns the
        stream's raw handle (``None`` off CUDA), to be given to :meth:`exit`."""
        self._lock.acquire()
        self._depth += 1
        if self.device.type != "cuda":
            return None
        # the raw handle, not a torch.cuda.Stream: this runs on every call
        index = self._index if self._index is not None else torch.cuda.current_device()
        raw = current_raw_stream(index)
        if self._depth == 1 and self._last_stream is not None and raw != self._last_raw:
            # recorded lazily, only on a switch: one stream's calls do no event work
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record(self._last_stream)
            self._stream(raw).wait_event(self._event)
            self.cross_stream_waits += 1
        return raw

    def exit(self, raw: Any) -> None:
        """Mark the stream :meth:`enter` returned (the caller's, still current) as the one
        holding the last call's GPU work; release the lock."""
        try:
            if raw is not None and self._depth == 1 and raw != self._last_raw:
                # the next switch records on it
                self._last_stream, self._last_raw = self._stream(raw), raw
        finally:
            self._depth -= 1
            self._lock.release()

    def _stream(self, raw: int) -> Any:
        """The ``torch.cuda.Stream`` of handle ``raw``, made once per stream, only on a switch."""
        stream = self._streams.get(raw)
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
            if stream.cuda_stream != raw:  # the caller left another stream current
                stream = torch.cuda.ExternalStream(raw, device=self.device)
            if len(self._streams) >= _STREAMS_KEPT:
                self._streams.clear()
            self._streams[raw] = stream
        return stream

    def __enter__(self) -> Any:
        raw = self.enter()
        if self._depth == 1:  # a nested enter keeps the outer one's stream for its exit
            self._raw = raw
        return raw

    def __exit__(self, *exc: Any) -> None:
        # under the lock still: no other call has replaced _raw since this one's enter
        self.exit(self._raw if self._depth == 1 else None)


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
