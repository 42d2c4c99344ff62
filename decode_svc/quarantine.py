"""Destination pages P may still write, held back after their request ended.

A request that ends before P's notice (abort, KV-wait timeout, SetDestination timing out) leaves
pages that P may be writing into right now, and D cannot revoke a peer's RMA access to its memory;
reusing them would let a late write overwrite another request's KV. They are released only on
(docs/architecture.md, Fencing one-sided writes):

* ``notice``: P's notice for the room, ok or not (P answers every accepted destination once);
* ``rejected``: SetDestination failed in a way that proves P holds nothing;
* ``process_gone``: P's same-host process (pid + start ticks) exited;
* ``new_incarnation``: the registry shows another start of P;
* ``fence_deadline``: D's send time of SetDestination + its RPC timeout + the write window + the
  fence margin passed; P starts no write after receipt + window by its own rule.

A registry record that is merely absent (an expired lease) decides nothing: a stopped P looks just
like that. The room stays taken meanwhile, so a new request reusing it is refused rather than
mistaken for the old one by a late notice.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from decode_svc.jobs import DecodeJob, DestState
from decode_svc.messages import DestResult, PeerGone, PrefillNet, ProcessId
from engine.kvcache.page_allocator import PageAllocator
from telemetry import metrics as M

log = logging.getLogger("halfmoon.decode")


@dataclass(eq=False)
class Quarantined:
    room: int
    pages: list[int]
    prefill_address: str
    prefill_segment: str
    prefill_incarnation: str
    fence_at: float                     # time.monotonic() after which P can no longer start a write
    process: ProcessId | None = None
    since: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class FencePolicy:
    """D's side of the write fence: the window asked of P and when quarantined pages may go.

    Args:
        rpc_timeout_s: SetDestination's deadline after D sends it (P refuses it later).
        write_window_s: P starts no write later than this after it received the destination.
        margin_s: covers the longest write already started at the window's end, and clock skew.
    """

    rpc_timeout_s: float = 10.0
    write_window_s: float = 30.0
    margin_s: float = 30.0

    @property
    def window_ms(self) -> int:
        return max(1, round(self.write_window_s * 1000))

    def stamp(self, job: DecodeJob) -> float:
        """Fix ``job.fence_at`` as the destination is sent; returns its RPC deadline (monotonic)."""
        deadline = time.monotonic() + self.rpc_timeout_s
        job.fence_at = deadline + self.write_window_s + self.margin_s
        return deadline


class Quarantine:
    """Quarantined destination pages by room (scheduler thread only).

    Args:
        allocator: D's page allocator (pages go back there).
        net: to abort an accepted destination whose request is gone.
    """

    def __init__(self, allocator: PageAllocator, net: PrefillNet):
        self.alloc = allocator
        self.net = net
        self._rooms: dict[int, Quarantined] = {}

    def __contains__(self, room: int) -> bool:
        return room in self._rooms

    def __len__(self) -> int:
        return len(self._rooms)

    @property
    def num_pages(self) -> int:
        return sum(len(q.pages) for q in self._rooms.values())

    def hold(self, job: DecodeJob) -> list[int]:
        """Take over ``job``'s destination pages (its request is ending); returns them, for the lease
        release to leave alone."""
        if not job.dst_pages:
            return []
        self._rooms[job.room] = Quarantined(job.room, list(job.dst_pages), job.prefill_address,
                                            job.prefill_segment or job.prefill_worker_id,
                                            job.prefill_incarnation, job.fence_at, job.prefill_process)
        log.info("room %d: %d destination pages quarantined until %s answers or is fenced (%.1f s)",
                 job.room, len(job.dst_pages), job.prefill_segment or job.prefill_address,
                 job.fence_at - time.monotonic())
        return job.dst_pages

    def release(self, room: int, cause: str) -> bool:
        """Free the room's pages (``cause``: one of ``M.QUARANTINE_RELEASE_CAUSES``); False when the
        room is not quarantined."""
        q = self._rooms.pop(room, None)
        if q is None:
            return False
        if q.pages:
            self.alloc.free(q.pages)
        M.DECODE_QUARANTINE_RELEASES.labels(cause=cause).inc()
        level = logging.WARNING if cause == "fence_deadline" else logging.INFO
        log.log(level, "room %d: %d quarantined pages released (%s; %s, held %.1f s)", room, len(q.pages),
                cause, q.prefill_segment or q.prefill_address, time.monotonic() - q.since)
        return True

    def on_dest_result(self, msg: DestResult) -> None:
        """SetDestination of a quarantined room finished: P never took it (release now), or took
        it (ask P to drop it; its notice releases the pages)."""
        q = self._rooms.get(msg.room)
        if q is None:
            return
        if msg.segment:
            q.prefill_segment, q.prefill_incarnation = msg.segment, msg.incarnation
            q.process = msg.process
        if msg.state is DestState.REJECTED:
            self.release(msg.room, "rejected")
        elif msg.state is DestState.ACCEPTED:
            self.net.abort(q.prefill_address, msg.room, "", "decode request ended")

    def on_peer_gone(self, msg: PeerGone) -> None:
        if not msg.proven:
            return
        for room, q in list(self._rooms.items()):
            if msg.matches(q.prefill_segment, q.prefill_incarnation):
                self.release(room, msg.cause)

    def expire(self, now: float) -> None:
        """Release rooms whose fence deadline passed (``now``: time.monotonic())."""
        for room, q in list(self._rooms.items()):
            if now > q.fence_at:
                self.release(room, "fence_deadline")

    def peers(self) -> set[tuple[str, str, ProcessId | None]]:
        """(segment, incarnation, process) of the prefill workers that may still write quarantined
        pages."""
        return {(q.prefill_segment, q.prefill_incarnation, q.process) for q in self._rooms.values()
                if q.prefill_segment}
