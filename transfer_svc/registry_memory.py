"""MemoryBackend: worker records and leases in the registry process (the default backend).

A reaper thread removes records whose lease was not renewed within its TTL. Everything is lost
when the registry restarts; workers then register again on their next heartbeat.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid

from protos import registry_pb2
from transfer_svc.registry_backend import Conflict, Held, RegistryBackend
from transfer_svc.registry_watch import WatchHub

log = logging.getLogger(__name__)
_Ev = registry_pb2.WorkerEvent


class MemoryBackend(RegistryBackend):
    """Args: reap_interval_s: how often expired leases are looked for (seconds)."""

    def __init__(self, reap_interval_s: float = 0.2):
        self.hub = WatchHub()
        self._lock = threading.Lock()
        self._held: dict[str, Held] = {}
        self._expires_at: dict[str, float] = {}  # worker id -> monotonic deadline
        self._revisions = itertools.count(1)
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, args=(reap_interval_s,),
                                        name="registry-reaper", daemon=True)
        self._reaper.start()

    def get(self, worker_id: str) -> Held | None:
        with self._lock:
            return self._held.get(worker_id)

    def list(self) -> list[Held]:
        with self._lock:
            return list(self._held.values())

    def put(self, record, secret_sha256, ttl_s, prev):
        wid = record.worker_id
        with self._lock:
            cur = self._held.get(wid)
            if (cur is None) != (prev is None) or (cur and cur.revision != prev.revision):
                raise Conflict(wid)
            held = Held(record, uuid.uuid4().hex, secret_sha256, ttl_s, next(self._revisions))
            self._held[wid] = held
            self._expires_at[wid] = time.monotonic() + ttl_s
            self.hub.apply(_Ev.ADDED if prev is None else _Ev.UPDATED, record)
            return held

    def renew(self, held):
        with self._lock:
            cur = self._held.get(held.record.worker_id)
            if cur is None or cur.lease_id != held.lease_id:
                return None
            self._expires_at[held.record.worker_id] = time.monotonic() + cur.ttl_s
            return cur.ttl_s

    def delete(self, held):
        with self._lock:
            cur = self._held.get(held.record.worker_id)
            if cur is None or cur.revision != held.revision:
                return False
            self._remove(cur, "unregistered")
            return True

    def close(self) -> None:
        self._stop.set()
        self.hub.close()

    def _remove(self, held: Held, reason: str) -> None:  # with _lock held
        wid = held.record.worker_id
        del self._held[wid]
        del self._expires_at[wid]
        self.hub.apply(_Ev.REMOVED, held.record, reason)

    def _reap_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            now = time.monotonic()
            with self._lock:
                for wid in [w for w, t in self._expires_at.items() if t < now]:
                    log.info("lease of worker %s expired", wid)
                    self._remove(self._held[wid], "lease expired")

