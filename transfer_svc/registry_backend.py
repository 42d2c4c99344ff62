"""Where the registry keeps worker records and leases: the `RegistryBackend` interface.

The registry service (`transfer_svc/registry.py`) validates requests and applies the ownership
rules; a backend only stores records under leases, compares-and-sets them, and feeds every change
into a `WatchHub` in store order. Two implementations:

  MemoryBackend (registry_memory.py)  in the registry process; lost on restart (the default)
  EtcdBackend   (registry_etcd.py)    etcd v3: one etcd lease per worker, changes from an etcd
                                      watch, so any number of registry replicas share one state

Both give the same contract (tests/integration/test_registry_contract.py runs it on each).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from protos import registry_pb2
from transfer_svc.registry_watch import WatchHub


class Conflict(Exception):
    """A compare-and-set lost: the record changed (or appeared) since it was read."""


class BackendUnavailable(Exception):
    """The store cannot be reached (the RPC ends UNAVAILABLE; callers retry)."""


@dataclass(frozen=True)
class Held:
    """One worker's record as stored, with its lease.

    lease_id: the store's lease name (memory: random hex; etcd: the etcd lease id in hex).
    secret_sha256: sha256 of the owner's lease secret (the secret itself is never stored).
    ttl_s: lease TTL, seconds.
    revision: the store's version of this record (the compare-and-set token).
    """
    record: registry_pb2.WorkerRecord
    lease_id: str
    secret_sha256: bytes
    ttl_s: int
    revision: int


class RegistryBackend(ABC):
    """Records under leases. Every method is thread-safe; `hub` sees each change once, in order
    (ADDED for a new record, UPDATED for a replacement, REMOVED with reason "unregistered" or
    "lease expired")."""

    hub: WatchHub

    @abstractmethod
    def get(self, worker_id: str) -> Held | None:
        """The live record of `worker_id`, or None. Raises BackendUnavailable."""

    @abstractmethod
    def list(self) -> list[Held]:
        """Every live record. Raises BackendUnavailable."""

    @abstractmethod
    def put(self, record: registry_pb2.WorkerRecord, secret_sha256: bytes, ttl_s: int,
            prev: Held | None) -> Held:
        """Store `record` under a new lease of `ttl_s` seconds: a new record when `prev` is None
        (Conflict if one exists), else a replacement of `prev` (Conflict unless the record is still
        at prev.revision; prev's lease ends). Raises Conflict, BackendUnavailable."""

    @abstractmethod
    def renew(self, held: Held) -> int | None:
        """Renew held's lease -> its TTL in seconds, or None when the lease is gone.
        Raises BackendUnavailable."""

    @abstractmethod
    def delete(self, held: Held) -> bool:
        """Remove the record (reason "unregistered") if it is still at held.revision -> whether it
        was. Raises BackendUnavailable."""

    @abstractmethod
    def close(self) -> None:
        """Stop background threads (leases in a shared store stay; they expire on their own)."""
