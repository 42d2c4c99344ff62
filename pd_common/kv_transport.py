"""The KV transport seam of a PD pair: what the prefill side sends with, what the decode side hears.

``transfer_svc.engine.TransferEngine`` implements both (one-sided UCX puts into D's registered pool
and a notice after the data). Schedulers are typed against these Protocols, so scheduler unit tests
can run P and D in one process over an in-process fake (``tests/fakes``) next to the real-process
tests — the same split SGLang keeps with its fake KV sender/receiver.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from transfer_svc.engine import BatchStatus, Notify, Segment


class KVSender(Protocol):
    """Prefill side: write page runs into a decode worker's pool, then notify it.

    A batch id names one submitted batch (or one notice) until ``release``. A notice is delivered
    only after every earlier batch to that segment completed, and fails if one of them failed.
    """

    def open_segment(self, name: str) -> Segment:
        """Open (or reuse) the named peer segment; may block on the registry. Raises TransferError."""

    def submit(self, segment: Segment, descs: Sequence[tuple[int, int, int]], *,
               not_after: float | None = None) -> int:
        """Queue puts of ``(local_addr, remote_addr, nbytes)``; returns the batch id. Raises
        SegmentClosed / BoundsError before anything is queued. A batch not posted by ``not_after``
        (time.monotonic() seconds) fails "write deadline passed" without writing."""

    def status(self, batch_id: int) -> BatchStatus: ...

    def wait(self, batch_id: int, timeout_s: float | None = None) -> BatchStatus: ...

    def release(self, batch_id: int) -> None: ...

    def send_notify(self, segment: Segment, payload: bytes, *, not_after: float | None = None) -> int:
        """Queue a notice (bytes) to the segment's owner behind every earlier batch; returns its id
        (``not_after`` as for submit)."""


class KVReceiver(Protocol):
    """Decode side: the notices prefill workers sent to this worker's segment."""

    def wait_notify(self, timeout_s: float) -> list[Notify]:
        """Notices received, waiting up to ``timeout_s`` seconds for the first."""
