"""The hand-over of the scheduler's stream items to D's ``grpc.aio`` streams: one loop wake-up per burst.

With the threaded server every token put on a request's ``SimpleQueue`` woke that stream's server
thread, which then blocked again on its write: per token per stream two thread switches fought
over the GIL with the scheduler thread (bench.decode_host: host µs per request-step). Here a
request's ``out`` is a :class:`StreamInbox`; its ``put`` (scheduler or any thread) appends to the
hub's one pending list and wakes the event loop only when no wake-up is pending yet, so the ~B
items of a decode step reach the loop in one ``call_soon_threadsafe``. On the loop the hub hands
each item to its stream's inbox; the stream's task (:func:`aio_stream_chunks`) wakes inside the
loop, without a thread switch, and sends every item waiting there in one chunk (``coalesce``,
``decode_svc.streams``).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable

from decode_svc.streams import EMPTY, next_chunks, over
from protos import decode_pb2


class StreamHub:
    """Items from any thread to the streams on ``loop`` (the aio server's)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[StreamInbox, object]] = []
        self._woken = False  # a _deliver is scheduled and has not taken the list yet

    def inbox(self) -> StreamInbox:
        """A new stream's queue (``DecodeJob.out``); create it on the loop."""
        return StreamInbox(self)

    def post(self, inbox: StreamInbox, item: object) -> None:
        with self._lock:
            self._pending.append((inbox, item))
            if self._woken:
                return
            self._woken = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # loop closed at shutdown: the server has stopped, no stream reads any more
            pass

    def _deliver(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
            self._woken = False
        for inbox, item in batch:
            inbox.items.append(item)
            inbox.ready.set()


class StreamInbox:
    """One stream's items in order (``DecodeChunk``s, then None or one ServiceError); ``put`` from
    any thread, read on the loop."""

    def __init__(self, hub: StreamHub):
        self._hub = hub
        self.items: deque = deque()
        self.ready = asyncio.Event()

    def put(self, item: object) -> None:
        self._hub.post(self, item)

    def take(self) -> object:
        """The next item, or ``EMPTY`` (on the loop)."""
        return self.items.popleft() if self.items else EMPTY


async def aio_stream_chunks(inbox: StreamInbox, *, keepalive_s: float, queued: Callable[[], bool],
                            coalesce: bool = True) -> AsyncIterator[decode_pb2.DecodeChunk]:
    """The chunks one Generate stream sends: ``decode_svc.streams.stream_chunks`` on the loop.

    Args:
        inbox: the job's ``out``.
        keepalive_s: before the first token, an empty DecodeChunk after this many seconds without
            one (0: none); never after the first token.
        queued: whether the request still waits in D (read when a keepalive is due).
        coalesce: merge every chunk already waiting into the one sent (False: one per item).

    Yields DecodeChunks; raises ``decode_svc.streams.StreamEnd`` when the request failed, after the chunks read before.
    """
    sent = False
    while True:
        if not inbox.items:
            inbox.ready.clear()
            try:
                await asyncio.wait_for(inbox.ready.wait(), keepalive_s if keepalive_s and not sent else None)
            except TimeoutError:
                if queued():  # still before the first token either way
                    yield decode_pb2.DecodeChunk()
            continue
        chunks, end = next_chunks(inbox.items.popleft(), inbox.take, coalesce)
        if chunks:
            sent = True
            for chunk in chunks:
                yield chunk
        if over(end):
            return
