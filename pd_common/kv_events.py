"""A worker's KV event publisher: its radix cache's stored / removed pages as a gRPC server stream
(``halfmoon.v1.KVEvents.Subscribe``, protos/kv_events.proto; docs/architecture.md, Router, KV events).

The scheduler thread drains the cache's ``CacheEvent``s after every iteration and hands them to
:meth:`KVEventPublisher.publish`, which numbers them as one batch (``seq`` 1, 2, ... per
incarnation), applies them to a mirror of the tree's pages (page hash -> parent hash, token start)
and keeps the last ``history`` batches. A subscriber gets a snapshot of the mirror with the seq it
reflects, then every later batch; one that asks to resume after a seq the publisher still holds
gets only what it missed, and one that falls behind the history gets a fresh snapshot. The mirror
is exact because every page entering the tree has an insert event and every page leaving it
(eviction, trim, invalidation) an evict event; invalidated-while-locked pages count as removed, as
no match can find them.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Sequence

from engine.kvcache.radix_node import CacheEvent
from protos import kv_events_pb2, kv_events_pb2_grpc

_KIND = {"insert": kv_events_pb2.KVPageRun.STORED, "evict": kv_events_pb2.KVPageRun.REMOVED}


class KVEventPublisher:
    """Thread-safe: one writer (the scheduler thread), many subscribers (gRPC threads).

    Args:
        worker_id: the worker's id (echoed in every batch).
        page_size: tokens per page.
        history: batches kept for subscribers that resume or lag (older ones get a snapshot).
    Attributes:
        incarnation: the worker's segment incarnation; set once the transfer engine exists, before
            the server starts.
    """

    def __init__(self, worker_id: str, page_size: int, history: int = 1024) -> None:
        self.worker_id = worker_id
        self.page_size = page_size
        self.incarnation = ""
        self._cond = threading.Condition()
        self._pages: dict[int, tuple[int, int]] = {}  # hash -> (parent hash, token start)
        self._seq = 0
        self._log: deque[kv_events_pb2.KVEventBatch] = deque(maxlen=history)
        self._closed = False

    @property
    def seq(self) -> int:
        return self._seq

    def pages(self) -> set[int]:
        """The page hashes the tree holds now (a copy)."""
        with self._cond:
            return set(self._pages)

    def publish(self, events: Sequence[CacheEvent]) -> None:
        """Record ``events`` (in order) as the next batch; nothing for an empty list."""
        if not events:
            return
        runs = []
        for ev in events:
            runs.append(kv_events_pb2.KVPageRun(kind=_KIND[ev.kind], page_hashes=ev.page_hashes,
                                                parent_hash=ev.parent_hash, token_start=ev.token_start))
        with self._cond:
            for ev in events:
                if ev.kind == "insert":
                    parent = ev.parent_hash
                    for i, h in enumerate(ev.page_hashes):
                        self._pages[h] = (parent, ev.token_start + i * self.page_size)
                        parent = h
                else:
                    for h in ev.page_hashes:
                        self._pages.pop(h, None)
            self._seq += 1
            self._log.append(self._batch(self._seq, False, runs))
            self._cond.notify_all()

    def close(self) -> None:
        """End every subscription (worker shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _batch(self, seq: int, snapshot: bool, runs) -> kv_events_pb2.KVEventBatch:
        return kv_events_pb2.KVEventBatch(incarnation=self.incarnation, seq=seq, snapshot=snapshot, runs=runs,
                                          page_size=self.page_size, worker_id=self.worker_id)

    def _snapshot(self) -> kv_events_pb2.KVEventBatch:
        """Under the lock: every page as a one-page STORED run, parents before children."""
        runs = [kv_events_pb2.KVPageRun(kind=kv_events_pb2.KVPageRun.STORED, page_hashes=[h],
                                        parent_hash=parent, token_start=start)
                for h, (parent, start) in sorted(self._pages.items(), key=lambda kv: kv[1][1])]
        return self._batch(self._seq, True, runs)

    def _since(self, after: int) -> list[kv_events_pb2.KVEventBatch] | None:
        """Under the lock: the batches after ``after``, or None when some of them are gone."""
        if after == self._seq:
            return []
        if after > self._seq or not self._log or self._log[0].seq > after + 1:
            return None
        return [b for b in self._log if b.seq > after]

    def stream(self, request: kv_events_pb2.SubscribeKVEventsRequest, active=lambda: True,
               poll_s: float = 1.0) -> Iterator[kv_events_pb2.KVEventBatch]:
        """The batches of one subscription (see the module docstring) until ``active()`` turns
        False or the publisher closes; ``poll_s``: how often ``active`` is checked while idle."""
        with self._cond:
            resume = self._since(request.after_seq) if request.incarnation == self.incarnation else None
            first = [self._snapshot()] if resume is None else resume
            sent = self._seq
        yield from first
        while active():
            with self._cond:
                if self._closed:
                    return
                if self._seq == sent:
                    self._cond.wait(poll_s)
                    continue
                out = self._since(sent)
                if out is None:  # fell behind the history: start over from a snapshot
                    out = [self._snapshot()]
                sent = self._seq
            yield from out


class KVEventsServicer(kv_events_pb2_grpc.KVEventsServicer):
    """``halfmoon.v1.KVEvents`` over a :class:`KVEventPublisher` (one server thread per subscriber)."""

    def __init__(self, publisher: KVEventPublisher) -> None:
        self.publisher = publisher

    def Subscribe(self, request, context):
        # add_callback, not is_active: a grpc.aio server's context for a plain handler has no is_active
        ended = threading.Event()
        if context.add_callback(ended.set) is False:  # grpc.server's: the call already ended
            return
        yield from self.publisher.stream(request, lambda: not ended.is_set())


SERVICE_NAME = kv_events_pb2.DESCRIPTOR.services_by_name["KVEvents"].full_name


def add_to_server(publisher: KVEventPublisher, server) -> None:
    """Register the KVEvents service on a worker's gRPC server."""
    kv_events_pb2_grpc.add_KVEventsServicer_to_server(KVEventsServicer(publisher), server)
