"""D's destinations on P: ``KVDestination`` messages held by room until P's request claims them.

D and P are called concurrently, so a destination may arrive before P has the request (buffered,
with a TTL) or after P finished computing (the request waits for it). Aborted, ended and expired
rooms leave a tombstone for a while, so that a late ``SetDestination`` or ``Prefill`` for them is
refused instead of holding pages forever. A room is used once: one that ended normally is refused
too (a late destination for it must never be written), with a message saying it ended.

What makes D's page release safe: P answers every destination it *accepted* with exactly one KV
notice (ok after the data, or ok=false when aborted/expired), so D can quarantine its destination
pages until that notice arrives.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from engine.kvcache.paging import pages_for
from pd_common.protocol import ServiceError
from prefill_svc.kv_runs import PoolGeometry

if TYPE_CHECKING:
    from prefill_svc.jobs import Destination


# what a tombstone says happened to its room
ABORTED, ENDED, EXPIRED = "aborted", "ended", "expired"


def tombstone_error(room: int, what: str) -> ServiceError:
    """The refusal of a late message for a tombstoned ``room``."""
    if what == ABORTED:
        return ServiceError(grpc.StatusCode.ABORTED, f"room {room} was aborted")
    if what == EXPIRED:
        return ServiceError(grpc.StatusCode.ABORTED,
                            f"room {room}: its destination expired before the prefill request came")
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                        f"room {room} has ended (a room is used by one request only)")


@dataclass
class HeldDestination:
    dest: object    # anything with a ``room`` (the scheduler holds ``jobs.Destination``)
    arrived: float  # monotonic seconds


class DestinationBook:
    """Room -> destination buffer with a TTL, plus tombstones of aborted/ended rooms.

    Thread-safe: servicer threads offer and abort, the scheduler thread takes and expires.
    Destinations are any objects with an int-like ``room``.

    Args:
        ttl_s: seconds an unclaimed destination is kept (P's "waiting for the request" bound).
        tombstone_s: seconds an aborted/finished room keeps refusing late messages.
        clock: monotonic clock in seconds (tests pass a fake).
    """

    def __init__(self, ttl_s: float, tombstone_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.tombstone_s = tombstone_s
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[int, HeldDestination] = {}
        self._claimed: set[int] = set()
        self._tombstones: dict[int, tuple[float, str]] = {}  # room -> (expiry, what happened)

    def offer(self, dest) -> str | None:
        """Buffer ``dest`` under ``dest.room``. Returns None when accepted, else why not: what its
        tombstone says (``ABORTED``, ``ENDED``, ``EXPIRED``) or "duplicate" (it has a destination)."""
        room = int(dest.room)
        with self._lock:
            self._gc_tombstones()
            if room in self._tombstones:
                return self._tombstones[room][1]
            if room in self._held or room in self._claimed:
                return "duplicate"
            self._held[room] = HeldDestination(dest, self._clock())
            return None

    def take(self, room: int):
        """The destination for ``room`` (removed from the buffer, room marked claimed), or None."""
        with self._lock:
            held = self._held.pop(room, None)
            if held is None:
                return None
            self._claimed.add(room)
            return held.dest

    def release(self, room: int, tombstone: bool = True):
        """The request owning ``room`` ended; keep a tombstone so late messages are refused.

        Returns the destination still buffered (unclaimed) for the room, to be answered, or None.
        """
        with self._lock:
            self._claimed.discard(room)
            held = self._held.pop(room, None)
            if tombstone:
                self._tombstone(room, ENDED)
            return held.dest if held else None

    def abort(self, room: int):
        """Tombstone ``room``; returns its unclaimed destination (to answer with ok=false) or None."""
        with self._lock:
            self._tombstone(room, ABORTED)
            held = self._held.pop(room, None)
            return held.dest if held else None

    def holds(self, room: int) -> bool:
        """Whether a destination for ``room`` is buffered (unclaimed)."""
        with self._lock:
            return room in self._held

    def ended(self, room: int) -> str | None:
        """What ended ``room`` (``ABORTED``, ``ENDED``, ``EXPIRED``) while it is tombstoned, else None."""
        with self._lock:
            self._gc_tombstones()
            t = self._tombstones.get(room)
            return t[1] if t else None

    def refusal(self, room: int) -> ServiceError | None:
        """The error for a late ``Prefill`` or ``SetDestination`` of a tombstoned room, else None."""
        what = self.ended(room)
        return tombstone_error(room, what) if what else None

    def expire(self) -> list:
        """Remove and return destinations unclaimed for longer than ``ttl_s`` (tombstoned)."""
        now = self._clock()
        out = []
        with self._lock:
            for room, held in list(self._held.items()):
                if now - held.arrived > self.ttl_s:
                    del self._held[room]
                    self._tombstone(room, EXPIRED)
                    out.append(held.dest)
            self._gc_tombstones()
        return out

    def held_rooms(self) -> int:
        """Rooms with a buffered (unclaimed) destination."""
        with self._lock:
            return len(self._held)

    def _tombstone(self, room: int, what: str) -> None:
        # the first cause stays: an aborted request's release must not turn it into "ended"
        expiry = self._clock() + self.tombstone_s
        old = self._tombstones.get(room)
        self._tombstones[room] = (expiry, old[1] if old else what)

    def _gc_tombstones(self) -> None:
        now = self._clock()
        for room in [r for r, (t, _) in self._tombstones.items() if t <= now]:
            del self._tombstones[room]


def check_destination(dest: Destination, prompt_len: int, page_size: int,
                      here: PoolGeometry) -> str | None:
    """Why ``dest`` cannot receive a prompt of ``prompt_len`` tokens from P's pool ``here``, or None.

    The pools' geometry is compared first: a D of another ``--page-size`` also miscounts pages, and
    the geometry message names the flag. Then D's ``prompt_len`` (0: unset), ``pre_len`` (D's
    prefix hit: page-aligned, <= prompt_len), the page count of the delta
    (``ceil(prompt_len / page_size) - pre_len / page_size``) and the page ids' range in D's pool.
    """
    m = dest.msg
    why = here.compatible(dest.geometry)
    if why:
        return why
    if m.prompt_len and m.prompt_len != prompt_len:
        return f"destination prompt_len {m.prompt_len} != prompt length {prompt_len}"
    if m.pre_len < 0 or m.pre_len > prompt_len or m.pre_len % page_size:
        return f"destination pre_len {m.pre_len} is not a page-aligned length <= {prompt_len}"
    want = pages_for(prompt_len, page_size) - m.pre_len // page_size
    if len(m.dst_page_ids) != want:
        return f"destination has {len(m.dst_page_ids)} pages; the delta needs {want}"
    if any(p < 0 or p >= dest.geometry.num_pages for p in m.dst_page_ids):
        return "destination page id outside the decode pool"
    return None
