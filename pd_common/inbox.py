"""A PD scheduler's inbox: the typed messages other threads send to the scheduler thread.

gRPC threads and network helper threads never touch a scheduler's jobs or KV; they post a message
and the scheduler thread handles it between forwards. Messages both workers take are defined here;
each worker adds its own (decode: notices, destination results, peer liveness).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass


@dataclass(frozen=True)
class Submit:
    """A new request (a ``PrefillJob`` or ``DecodeJob``)."""

    job: object


@dataclass(frozen=True)
class Abort:
    """End a request: ``job`` when set (a call's own termination), else the room's request, else
    (``room`` 0) every request with ``request_id``."""

    room: int
    request_id: str
    reason: str
    job: object = None
    sample: int | None = None  # only this sample of an n > 1 request (decode workers)


def abort_targets(jobs: Mapping[int, object], msg: Abort) -> list:
    """The live jobs (``jobs``: room -> job) that ``msg`` ends. A named job counts only while it is
    still its room's job: a refused duplicate shares the room of the request it collided with."""
    if msg.job is not None:
        return [msg.job] if jobs.get(msg.job.room) is msg.job else []
    if msg.room:
        job = jobs.get(msg.room)
        return [] if job is None else [job]
    return [j for j in jobs.values() if msg.request_id and j.request_id == msg.request_id]


@dataclass(frozen=True)
class LoadQuery:
    """Report the load and KV accounting into ``reply`` (a ``common_pb2.LoadReport``); with
    ``per_rank`` also every tensor-parallel rank's (``LoadReport.ranks``)."""

    reply: Future
    per_rank: bool = False


@dataclass(frozen=True)
class Wake:
    """No content: makes the loop run an iteration now (shutdown, a new destination)."""


class Inbox:
    """Many writers, one reader (the scheduler thread)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()

    def post(self, msg: object) -> None:
        self._q.put(msg)

    def drain(self, wait_s: float, handle: Callable[[object], None]) -> None:
        """Handle every queued message; waits up to ``wait_s`` seconds for the first (0: no wait)."""
        try:
            msg = self._q.get(timeout=wait_s) if wait_s > 0 else self._q.get_nowait()
        except queue.Empty:
            return
        while True:
            handle(msg)
            try:
                msg = self._q.get_nowait()
            except queue.Empty:
                return

    def pending_jobs(self) -> list:
        """Jobs still queued and never seen by the loop, taken without blocking (at shutdown, so
        their callers are answered)."""
        jobs = []
        while True:
            try:
                msg = self._q.get_nowait()
            except queue.Empty:
                return jobs
            if isinstance(msg, Submit):
                jobs.append(msg.job)
