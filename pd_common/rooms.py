"""Which rooms and request ids a worker knows, readable from any thread.

A room is the router-chosen id that pairs one request's prefill and decode legs. gRPC threads
answer ``Abort(found=...)`` and map a request id to its room without waiting for the scheduler
thread (which may be inside a long forward), so the mapping lives behind its own lock.
"""

from __future__ import annotations

import threading


class KnownRooms:
    """Rooms with a request on this worker, and request id -> room."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rooms: set[int] = set()
        self._rids: dict[str, int] = {}

    def add(self, room: int, request_id: str) -> None:
        with self._lock:
            self._rooms.add(room)
            self._rids[request_id] = room

    def discard(self, room: int, request_id: str) -> None:
        """Forget ``room``, and ``request_id`` if it still names this room."""
        with self._lock:
            self._rooms.discard(room)
            if self._rids.get(request_id) == room:
                del self._rids[request_id]

    def resolve(self, room: int, request_id: str) -> tuple[int, bool]:
        """(room, known): ``room`` itself when non-zero, else the room of ``request_id`` (0 if none)."""
        with self._lock:
            room = room or self._rids.get(request_id, 0)
            return room, room in self._rooms
