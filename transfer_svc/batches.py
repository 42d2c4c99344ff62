"""Batch records and the table of batch ids that callers poll and wait on.

A batch is one submit (a list of puts or gets to one segment) or one notify. Caller threads create
and read batches here; the progress thread moves them to a terminal state (transfer_svc.inflight)
and sets their event.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

from transfer_svc.types import BatchStatus, Segment, State

# Terminal batches are kept for status() until this many are known, oldest dropped first.
_MAX_KEPT_BATCHES = 100_000


@dataclass
class Batch:
    bid: int
    segment: Segment | None
    total: int             # bytes (of the transfers, or of a notify's payload)
    deadline: float        # time.monotonic() seconds
    state: State = State.PENDING
    done: int = 0          # bytes known complete
    reason: str = ""
    kind: str = "write"    # "write" | "read" | "notify"
    started: float = 0.0   # time.monotonic() at submit
    timeout: float = 0.0   # seconds from submit to deadline
    nops: int = 0          # UCX operations posted (after coalescing)
    after: "Batch | None" = None  # notify only: the last batch to its segment before it
    not_after: float | None = None  # monotonic seconds: refused (FAILED) if not posted by then
    request: int = 0       # pending ucp request (flush or am send)
    keep: object = None    # buffers that must outlive the request
    event: threading.Event = field(default_factory=threading.Event)

    def status(self) -> BatchStatus:
        return BatchStatus(self.state, self.done, self.total, self.reason)


class BatchTable:
    """Batch id -> Batch. Ids count up from 1 and are never reused.

    Args:
        timeout_s: default deadline of a batch, seconds after it is created.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._batches: collections.OrderedDict[int, Batch] = collections.OrderedDict()
        self._next_bid = 1
        self._lock = threading.Lock()

    def new(self, seg: Segment | None, total: int, timeout_s: float | None) -> Batch:
        """A PENDING batch of `total` bytes to `seg`, due in timeout_s seconds (None: default)."""
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        with self._lock:
            bid = self._next_bid
            self._next_bid += 1
            now = time.monotonic()
            b = Batch(bid, seg, total, now + t, started=now)
            b.timeout = t
            self._batches[bid] = b
            while len(self._batches) > _MAX_KEPT_BATCHES:
                oldest = next(iter(self._batches.values()))
                if oldest.state is State.PENDING:
                    break
                self._batches.popitem(last=False)
        return b

    def timeout_of(self, b: Batch) -> float:
        """The batch's timeout in seconds (the default when it was created with 0)."""
        return b.timeout or self.timeout_s

    def _get(self, bid: int) -> Batch:
        with self._lock:
            b = self._batches.get(bid)
        if b is None:
            raise KeyError(f"unknown batch id {bid}")
        return b

    def status(self, bid: int) -> BatchStatus:
        """The batch's status now; KeyError for an unknown (or released) id."""
        return self._get(bid).status()

    def wait(self, bid: int, timeout_s: float | None = None) -> BatchStatus:
        """Block until the batch is terminal or timeout_s seconds pass (None: its own timeout plus
        5 s), then return its status; KeyError for an unknown id."""
        b = self._get(bid)
        b.event.wait(timeout_s if timeout_s is not None else self.timeout_of(b) + 5.0)
        return b.status()

    def release(self, bid: int) -> None:
        """Forget a terminal batch id; unknown or PENDING ids are left alone."""
        with self._lock:
            b = self._batches.get(bid)
            if b is not None and b.state is not State.PENDING:
                del self._batches[bid]
