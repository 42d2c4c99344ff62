"""An in-process KV transport: P's ``KVSender`` and D's ``KVReceiver`` over memory of one process.

Same contract as ``transfer_svc.engine.TransferEngine`` for what the PD schedulers use: a segment
is opened by name and carries its owner's ``registry_pb2.KVLayout``; ``submit`` checks every range
against the registered (local) and published (remote) memory before queuing anything and returns a
batch id; a notice is delivered to the owner's ``wait_notify`` only after every batch submitted
before it on that handle completed, and fails (is never delivered) if one of them failed; a failed
batch drops its handle like a dead peer does (pending work on it fails, ``submit`` raises
``SegmentClosed``, ``open_segment(name)`` gives a fresh handle). Writes are ``ctypes.memmove`` from
local to remote addresses, so both pools must be CPU memory of this process.

Test hooks on the ``FakeFabric``: ``hold(name)`` keeps every write to that segment PENDING (and
so every notice behind it) until ``release_held()`` copies and completes them or ``fail_held()``
fails them; ``held(name)`` counts the writes waiting; ``drop(handle)`` kills one handle.

    fabric = FakeFabric()
    p, d = fabric.engine("prefill-0"), fabric.engine("decode-0")
    p.register_pool(p_pool); d.register_pool(d_pool); d.publish(kv_layout(d_pool, model))
    seg = p.open_segment("decode-0")
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from protos import registry_pb2
from transfer_svc.engine import BatchStatus, BoundsError, Notify, SegmentClosed, State


@dataclass(eq=False)
class FakeSegment:
    """An open handle on a published segment (the attributes ``transfer_svc.engine.Segment``
    has that callers read)."""

    name: str
    incarnation: str
    kv_layout: registry_pb2.KVLayout
    owner: FakeTransfer
    alive: bool = True
    failure: str = ""
    pending: list = field(default_factory=list, repr=False)  # _Batch, submit order


@dataclass(eq=False)
class _Batch:
    bid: int
    segment: FakeSegment
    total: int
    descs: list[tuple[int, int, int]] = field(default_factory=list)  # writes; none for a notice
    payload: bytes | None = None                                   # a notice's bytes
    sender: str = ""                                               # the submitting engine
    state: State = State.PENDING
    reason: str = ""
    done: threading.Event = field(default_factory=threading.Event)

    def status(self) -> BatchStatus:
        return BatchStatus(self.state, self.total if self.state is State.COMPLETED else 0,
                           self.total, self.reason)


def _inside(regions: Sequence[tuple[int, int]], addr: int, n: int) -> bool:
    return any(base <= addr and addr + n <= base + length for base, length in regions)


class FakeFabric:
    """The process's "network": published segments, the engines, the hold hook. One lock guards
    everything (schedulers, helper threads and the test thread call in concurrently)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.published: dict[str, FakeTransfer] = {}
        self._held: set[str] = set()
        self._handles: list[FakeSegment] = []
        self._ids = itertools.count(1)

    def engine(self, name: str) -> FakeTransfer:
        return FakeTransfer(self, name)

    # ------------------------------------------------------------------ test hooks
    def hold(self, name: str) -> None:
        """Keep writes to segment ``name`` PENDING from now on (notices queue behind them)."""
        with self.lock:
            self._held.add(name)

    def held(self, name: str) -> int:
        """Writes to segment ``name`` waiting on the hold."""
        with self.lock:
            return sum(b.payload is None for s in self._handles if s.name == name for b in s.pending)

    def release_held(self) -> None:
        """End every hold: copy and complete the held writes in order, then deliver the notices
        behind them."""
        with self.lock:
            self._held.clear()
            for seg in list(self._handles):
                self.pump(seg)

    def fail_held(self, reason: str = "peer unreachable") -> None:
        """End every hold by failing the held writes (nothing copied): their handles are dropped,
        so the notices behind them fail too."""
        with self.lock:
            for seg in [s for s in self._handles if s.name in self._held and s.pending]:
                self.drop(seg, reason)
            self._held.clear()

    def drop(self, seg: FakeSegment, reason: str) -> None:
        """Drop one handle as a dead peer does: its pending writes and notices fail, ``submit`` on
        it raises SegmentClosed, and ``open_segment`` gives a new handle."""
        with self.lock:
            seg.alive, seg.failure = False, reason
            for b in seg.pending:
                self._finish(b, State.FAILED, reason if b.payload is None else f"earlier batch failed: {reason}")
            seg.pending.clear()
            if seg in self._handles:
                self._handles.remove(seg)

    # ------------------------------------------------------------------ internals
    def next_id(self) -> int:
        return next(self._ids)

    def open(self, name: str) -> FakeSegment:
        owner = self.published.get(name)
        if owner is None:
            raise KeyError(f"segment {name!r} is not published")
        seg = FakeSegment(name, owner.incarnation, owner.kv_layout, owner)
        self._handles.append(seg)
        return seg

    def pump(self, seg: FakeSegment) -> None:
        """Run ``seg``'s queue head first: writes unless held, then the notices they gate."""
        while seg.pending:
            b = seg.pending[0]
            if b.payload is None:
                if seg.name in self._held:
                    return
                for local, remote, n in b.descs:
                    ctypes.memmove(remote, local, n)
            else:
                seg.owner.deliver(Notify(b.sender, b.payload))
            seg.pending.pop(0)
            self._finish(b, State.COMPLETED)

    @staticmethod
    def _finish(b: _Batch, state: State, reason: str = "") -> None:
        b.state, b.reason = state, reason
        b.done.set()


class FakeTransfer:
    """One worker's end of the fabric: a ``KVSender`` (open_segment, submit, status, wait, release,
    send_notify) and a ``KVReceiver`` (wait_notify, poll_notifies).

    Attributes: name and incarnation (as ``TransferEngine``), kv_layout once published.
    """

    def __init__(self, fabric: FakeFabric, name: str):
        self.fabric = fabric
        self.name = name
        self.incarnation = uuid.uuid4().hex
        self.kv_layout: registry_pb2.KVLayout | None = None
        self._regions: list[tuple[int, int]] = []  # (base, bytes)
        self._open: dict[str, FakeSegment] = {}
        self._batches: dict[int, _Batch] = {}
        self._inbox: list[Notify] = []
        self._notified = threading.Condition(fabric.lock)

    # ------------------------------------------------------------------ memory and segments
    def register_memory(self, ptr: int, length: int, location: str = "cpu") -> None:
        if location != "cpu":
            raise ValueError("the fake transport copies CPU memory only")
        with self.fabric.lock:
            self._regions.append((int(ptr), int(length)))

    def register_pool(self, kv_pool) -> None:
        """Register every buffer of an ``engine.kvcache.kv_pool.KVPool`` (CPU)."""
        for buf in kv_pool.buffers():
            self.register_memory(buf.data_ptr(), buf.numel() * buf.element_size())

    def publish(self, kv_layout: registry_pb2.KVLayout) -> None:
        """Make this engine's registered memory openable by name, described by ``kv_layout``."""
        with self.fabric.lock:
            self.kv_layout = kv_layout
            self.fabric.published[self.name] = self

    def open_segment(self, name: str) -> FakeSegment:
        """The live handle on ``name`` (a new one after a drop). Raises KeyError if unpublished."""
        with self.fabric.lock:
            seg = self._open.get(name)
            if seg is None or not seg.alive:
                seg = self._open[name] = self.fabric.open(name)
            return seg

    # ------------------------------------------------------------------ KVSender
    def submit(self, seg: FakeSegment, descs: Sequence[tuple[int, int, int]], *,
               not_after: float | None = None) -> int:
        """Queue writes of ``(local_addr, remote_addr, nbytes)``; returns the batch id. Raises
        SegmentClosed (dropped handle) or BoundsError (a range outside registered/published
        memory) before anything is queued. ``not_after`` is accepted and not enforced (the fake
        has no progress thread to be late on)."""
        with self.fabric.lock:
            self._check_alive(seg)
            writes = [(int(a), int(b), int(n)) for a, b, n in descs]
            for i, (local, remote, n) in enumerate(writes):
                if not _inside(self._regions, local, n):
                    raise BoundsError(f"descriptor {i}: local range [{local:#x}, +{n}) is not registered")
                if not _inside(seg.owner._regions, remote, n):
                    raise BoundsError(f"descriptor {i}: remote range [{remote:#x}, +{n}) is outside "
                                      f"segment {seg.name!r}")
            return self._queue(_Batch(self.fabric.next_id(), seg, sum(w[2] for w in writes), writes,
                                      sender=self.name))

    def send_notify(self, seg: FakeSegment, payload: bytes, *, not_after: float | None = None) -> int:
        """Queue a notice to ``seg``'s owner behind every earlier batch on the handle; its id."""
        with self.fabric.lock:
            self._check_alive(seg)
            payload = bytes(payload)
            return self._queue(_Batch(self.fabric.next_id(), seg, len(payload), payload=payload,
                                      sender=self.name))

    def status(self, batch_id: int) -> BatchStatus:
        with self.fabric.lock:
            return self._batch(batch_id).status()

    def wait(self, batch_id: int, timeout_s: float | None = None) -> BatchStatus:
        with self.fabric.lock:
            b = self._batch(batch_id)
        b.done.wait(timeout_s)
        with self.fabric.lock:
            return b.status()

    def release(self, batch_id: int) -> None:
        """Forget a terminal batch id."""
        with self.fabric.lock:
            b = self._batches.get(batch_id)
            if b is not None and b.state is not State.PENDING:
                del self._batches[batch_id]

    # ------------------------------------------------------------------ KVReceiver
    def wait_notify(self, timeout_s: float) -> list[Notify]:
        """Notices received, waiting up to ``timeout_s`` seconds for the first."""
        with self._notified:
            self._notified.wait_for(lambda: self._inbox, timeout_s)
            return self.poll_notifies()

    def poll_notifies(self) -> list[Notify]:
        with self.fabric.lock:
            out, self._inbox = self._inbox, []
            return out

    def deliver(self, notice: Notify) -> None:
        with self._notified:
            self._inbox.append(notice)
            self._notified.notify_all()

    # ------------------------------------------------------------------ internals
    def _check_alive(self, seg: FakeSegment) -> None:
        if not isinstance(seg, FakeSegment):
            raise TypeError(f"expected a FakeSegment from open_segment, got {type(seg).__name__}")
        if not seg.alive:
            raise SegmentClosed(f"segment {seg.name!r} was dropped ({seg.failure}); open it again")

    def _queue(self, b: _Batch) -> int:
        self._batches[b.bid] = b
        b.segment.pending.append(b)
        self.fabric.pump(b.segment)
        return b.bid

    def _batch(self, batch_id: int) -> _Batch:
        b = self._batches.get(batch_id)
        if b is None:
            raise KeyError(f"unknown batch id {batch_id}")
        return b
