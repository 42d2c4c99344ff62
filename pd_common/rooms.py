"""Which rooms and request ids a worker knows, readable from any thread.

A room is the router-chosen id that pairs one request's prefill and decode legs. gRPC threads
answer ``Abort(found=...)`` and map a request id to its rooms without waiting for the scheduler
thread (which may be inside a long forward), so the mapping lives behind its own lock.

Only an accepted request is recorded: ``claim`` refuses a room another request holds and records
nothing then, and ``discard`` forgets only what the same job claimed, so a refused duplicate never
touches the request it collided with.

A request id may name several live rooms: the router retries a failed attempt with the same
request id and a new room, possibly on the same workers, while the first attempt's abort is still
on its way. Refusing the second would fail the retry, so rooms stay the identity and an abort by
request id alone (room 0) ends every live request with that id on the worker.
"""

from __future__ import annotations

import threading


class KnownRooms:
    """Room -> the job holding it, and request id -> its rooms. Jobs have ``room`` and
    ``request_id``; they are compared by identity."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rooms: dict[int, object] = {}
        self._rids: dict[str, set[int]] = {}

    def claim(self, job) -> bool:
        """Record ``job``'s room and request id; False (nothing recorded) when the room is held."""
        with self._lock:
            if job.room in self._rooms:
                return False
            self._rooms[job.room] = job
            if job.request_id:
                self._rids.setdefault(job.request_id, set()).add(job.room)
            return True

    def discard(self, job) -> None:
        """Forget what ``job`` claimed; a no-op for a job that holds nothing (refused, or ended)."""
        with self._lock:
            if self._rooms.get(job.room) is not job:
                return
            del self._rooms[job.room]
            rooms = self._rids.get(job.request_id)
            if rooms is not None:
                rooms.discard(job.room)
                if not rooms:
                    del self._rids[job.request_id]

    def knows(self, room: int, request_id: str) -> bool:
        """Whether a request holds ``room`` (when non-zero), else whether ``request_id`` names one."""
        with self._lock:
            if room:
                return room in self._rooms
            return bool(request_id) and bool(self._rids.get(request_id))
