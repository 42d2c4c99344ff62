"""The router's exact per-worker prefix index, built from the workers' KV events
(protos/kv_events.proto; docs/architecture.md, Router, KV events).

Each worker's index is the set of chained page keys (``engine.kvcache.page_hash``) its radix cache
holds, as of the last batch applied (``seq``) of one incarnation. A key stands for its whole prefix
and the tree holds whole prefixes, so "how many leading tokens of this prompt does the worker
hold" is the number of leading keys in the set, times the page size. Unlike
``router_svc.prefix_index.PrefixIndex`` (the router's memory of its own past picks) this learns
evictions, invalidations and restarts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from protos import kv_events_pb2

log = logging.getLogger("halfmoon.router.kv_index")


class GapError(Exception):
    """A batch does not follow the last one applied: resubscribe (the worker sends a snapshot)."""


@dataclass
class WorkerKVIndex:
    """One worker's pages. ``incarnation`` "" and ``seq`` 0 until the first snapshot."""

    worker_id: str
    incarnation: str = ""
    seq: int = 0
    page_size: int = 0
    pages: set[int] = field(default_factory=set)
    resyncs: int = 0  # snapshots applied after the first (gaps, dropped streams, restarts)
    stored_total: int = 0  # pages in STORED / REMOVED runs applied (snapshots not counted)
    removed_total: int = 0

    def apply(self, batch: kv_events_pb2.KVEventBatch) -> None:
        """Apply one batch of a subscription.

        Raises:
            GapError: a non-snapshot batch of another incarnation or not numbered ``seq + 1``
                (nothing is applied).
        """
        if batch.snapshot:
            if self.incarnation and batch.incarnation != self.incarnation:
                log.info("worker %s restarted (incarnation %s -> %s): index dropped",
                         self.worker_id, self.incarnation, batch.incarnation)
            if self.incarnation:
                self.resyncs += 1
            self.pages = {h for run in batch.runs for h in run.page_hashes}
            self.incarnation, self.seq, self.page_size = batch.incarnation, batch.seq, batch.page_size
            return
        if batch.incarnation != self.incarnation or batch.seq != self.seq + 1:
            raise GapError(f"worker {self.worker_id}: batch {batch.incarnation}/{batch.seq} after "
                           f"{self.incarnation}/{self.seq}")
        for run in batch.runs:
            if run.kind == kv_events_pb2.KVPageRun.STORED:
                self.pages.update(run.page_hashes)
                self.stored_total += len(run.page_hashes)
            else:
                self.pages.difference_update(run.page_hashes)
                self.removed_total += len(run.page_hashes)
        self.seq = batch.seq

    def match(self, keys: list[int]) -> int:
        """Leading pages of ``keys`` (a prompt's chained page keys) that this worker holds."""
        n = 0
        for k in keys:
            if k not in self.pages:
                break
            n += 1
        return n


class KVEventIndex:
    """Every worker's :class:`WorkerKVIndex`, by worker id (the router's event loop only)."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerKVIndex] = {}

    def get(self, worker_id: str) -> WorkerKVIndex:
        if worker_id not in self.workers:
            self.workers[worker_id] = WorkerKVIndex(worker_id)
        return self.workers[worker_id]

    def matched_pages(self, worker_id: str, keys: list[int]) -> int:
        """Leading pages of ``keys`` the worker holds (0 for a worker not yet synchronised)."""
        idx = self.workers.get(worker_id)
        return 0 if idx is None else idx.match(keys)

    def size(self, worker_id: str) -> int:
        """Pages the worker holds (0 when not yet synchronised)."""
        idx = self.workers.get(worker_id)
        return 0 if idx is None else len(idx.pages)

    def forget(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)
