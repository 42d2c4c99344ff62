"""Destination pages P may still write, held back after their request ended.

A request that ends before P's notice (abort, KV-wait timeout, SetDestination timing out) leaves
pages that P may be writing into right now; reusing them would let a late transfer overwrite
another request's KV. They are released when P's notice for the room arrives (P answers every
accepted destination exactly once), when P says it never took the destination, when P's segment
incarnation is gone, or after the fence timeout. The room stays taken meanwhile, so a new request
reusing it is refused rather than mistaken for the old one by a late notice.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from decode_svc.jobs import DecodeJob, DestState
from decode_svc.messages import DestResult, PeerGone, PrefillNet
from engine.kvcache.page_allocator import PageAllocator

log = logging.getLogger("halfmoon.decode")


@dataclass(eq=False)
class Quarantined:
    room: int
    pages: list[int]
    prefill_address: str
    prefill_segment: str
    prefill_incarnation: str
    since: float = field(default_factory=time.monotonic)


class Quarantine:
    """Quarantined destination pages by room (scheduler thread only).

    Args:
        allocator: D's page allocator (pages go back there).
        net: to abort an accepted destination whose request is gone.
        fence_timeout_s: seconds after which pages with no notice and a live P are released.
    """

    def __init__(self, allocator: PageAllocator, net: PrefillNet, fence_timeout_s: float):
        self.alloc = allocator
        self.net = net
        self.fence_timeout_s = fence_timeout_s
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
                                            job.prefill_incarnation)
        return job.dst_pages

    def release(self, room: int) -> bool:
        """Free the room's pages; False when the room is not quarantined."""
        q = self._rooms.pop(room, None)
        if q is None:
            return False
        if q.pages:
            self.alloc.free(q.pages)
        return True

    def on_dest_result(self, msg: DestResult) -> None:
        """SetDestination of a quarantined room finished: P never took it (release now), or took
        it (ask P to drop it; its notice releases the pages)."""
        q = self._rooms.get(msg.room)
        if q is None:
            return
        if msg.segment:
            q.prefill_segment, q.prefill_incarnation = msg.segment, msg.incarnation
        if msg.state is DestState.REJECTED:
            self.release(msg.room)
        elif msg.state is DestState.ACCEPTED:
            self.net.abort(q.prefill_address, msg.room, "", "decode request ended")

    def on_peer_gone(self, msg: PeerGone) -> None:
        for room, q in list(self._rooms.items()):
            if msg.matches(q.prefill_segment, q.prefill_incarnation):
                self.release(room)

    def expire(self, now: float) -> None:
        """Release rooms quarantined longer than the fence timeout (``now``: time.monotonic())."""
        for room, q in list(self._rooms.items()):
            if now - q.since > self.fence_timeout_s:
                log.warning("room %d: no notice from %s after %.0f s; releasing %d quarantined pages",
                            room, q.prefill_segment or q.prefill_address, now - q.since, len(q.pages))
                self.release(room)

    def peers(self) -> set[tuple[str, str]]:
        """(segment, incarnation) of the prefill workers that may still write quarantined pages."""
        return {(q.prefill_segment, q.prefill_incarnation) for q in self._rooms.values()
                if q.prefill_segment}
