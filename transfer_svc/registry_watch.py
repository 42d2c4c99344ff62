"""WatchHub: the registry's view of current records and its open WatchWorkers streams.

A backend calls `apply` for each change in store order; every subscriber gets the events of its
role in that order, after a snapshot of the records current when it subscribed. The worker gauges
and the expired-lease counter are kept here, so both backends report them the same way.
"""

from __future__ import annotations

import queue
import threading

from protos import registry_pb2
from telemetry import metrics

ROLE_NAMES = {registry_pb2.PREFILL: "prefill", registry_pb2.DECODE: "decode"}
_Ev = registry_pb2.WorkerEvent


class WatchHub:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, registry_pb2.WorkerRecord] = {}
        self._subs: list[tuple[int, queue.Queue]] = []
        self._closed = False

    def apply(self, kind: int, record: registry_pb2.WorkerRecord, reason: str = "") -> None:
        """One change: kind is WorkerEvent.ADDED / UPDATED / REMOVED (reason for REMOVED:
        "unregistered" | "lease expired")."""
        ev = _Ev(kind=kind, worker=record, reason=reason)
        with self._lock:
            if kind == _Ev.REMOVED:
                self._records.pop(record.worker_id, None)
            else:
                self._records[record.worker_id] = record
            for role, q in self._subs:
                if role in (registry_pb2.ROLE_UNSPECIFIED, record.role):
                    q.put(ev)
            for r, name in ROLE_NAMES.items():
                metrics.REGISTRY_WORKERS.labels(role=name).set(
                    sum(1 for rec in self._records.values() if rec.role == r))
        if kind == _Ev.REMOVED and reason == "lease expired":
            metrics.REGISTRY_EXPIRED_LEASES.inc()

    def resync(self, records: dict[str, registry_pb2.WorkerRecord]) -> None:
        """Make the view equal `records` (after a lost watch), emitting the difference: records
        gone are REMOVED ("lease expired": nothing else says why), new ones ADDED, changed ones
        UPDATED (watchers compare the segment incarnation it carries)."""
        with self._lock:
            old = dict(self._records)
        for wid, rec in old.items():
            if wid not in records:
                self.apply(_Ev.REMOVED, rec, "lease expired")
        for wid, rec in records.items():
            prev = old.get(wid)
            if prev is None:
                self.apply(_Ev.ADDED, rec)
            elif prev != rec:
                self.apply(_Ev.UPDATED, rec)

    def subscribe(self, role: int) -> tuple[list[registry_pb2.WorkerRecord], queue.Queue]:
        """-> (snapshot of role's records, queue of later events; None in it = closed)."""
        q: queue.Queue = queue.Queue()
        with self._lock:
            if self._closed:
                q.put(None)
            snapshot = [r for r in self._records.values()
                        if role in (registry_pb2.ROLE_UNSPECIFIED, r.role)]
            self._subs.append((role, q))
        return snapshot, q

    def unsubscribe(self, q: queue.Queue) -> None:
        with self._lock:
            self._subs = [(r, s) for r, s in self._subs if s is not q]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for _, q in self._subs:
                q.put(None)
