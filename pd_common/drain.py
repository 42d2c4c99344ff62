"""Graceful drain of a worker on SIGTERM (docs/architecture.md, Shutdown).

SIGTERM -> health NOT_SERVING (the router stops picking the worker at its next check) and new
requests are refused with UNAVAILABLE (a router that picked it meanwhile retries on another pair,
before any token) -> running calls get ``--drain-grace-s`` to finish -> the rest are ended with
UNAVAILABLE and trailing metadata ``halfmoon-migrate: drain``, which the router answers by
migrating the stream to another pair (router_svc/migration.py) -> the usual shutdown. A second
SIGTERM/SIGINT cuts the grace short.
"""

from __future__ import annotations

import contextlib
import threading
import time

import grpc

# Trailing metadata of a stream a worker hands back to the router to continue elsewhere.
MIGRATE_KEY = "halfmoon-migrate"
MIGRATE_DRAIN = "drain"


class Drain:
    """Counts a servicer's running calls and refuses new ones once draining; thread safe.

    Args:
        role: "prefill" | "decode", for messages.
        grace_s: seconds running calls get to finish once draining starts (``--drain-grace-s``).
    """

    def __init__(self, role: str, grace_s: float) -> None:
        self.role = role
        self.grace_s = grace_s
        self._cond = threading.Condition()
        self._active = 0
        self.draining = False
        self.hurry = threading.Event()  # a second signal: stop waiting

    @property
    def active(self) -> int:
        return self._active

    def refuse_new(self, context: grpc.ServicerContext) -> None:
        """Abort the call with UNAVAILABLE when draining (call before anything is allocated)."""
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, self._refusal())

    async def refuse_new_aio(self, context: grpc.aio.ServicerContext) -> None:
        """:meth:`refuse_new` for a ``grpc.aio`` handler."""
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._refusal())

    def _refusal(self) -> str:
        return f"{self.role} worker is draining (shutting down): it takes no new request"

    @contextlib.contextmanager
    def track(self):
        """Count one running call for as long as the block runs."""
        with self._cond:
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def begin(self) -> None:
        self.draining = True

    def wait_idle(self, seconds: float) -> int:
        """Wait until no call runs, ``seconds`` passed or :attr:`hurry` is set; returns the calls
        still running."""
        deadline = time.monotonic() + seconds
        with self._cond:
            while self._active and not self.hurry.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.1))
            return self._active

    @staticmethod
    def hand_back(context: grpc.ServicerContext, what: str) -> None:
        """End a stream with the status the router migrates (UNAVAILABLE + ``halfmoon-migrate``)."""
        context.set_trailing_metadata(((MIGRATE_KEY, MIGRATE_DRAIN),))
        context.abort(grpc.StatusCode.UNAVAILABLE, _handed_back(what))

    @staticmethod
    async def hand_back_aio(context: grpc.aio.ServicerContext, what: str) -> None:
        """:meth:`hand_back` for a ``grpc.aio`` handler."""
        context.set_trailing_metadata(((MIGRATE_KEY, MIGRATE_DRAIN),))
        await context.abort(grpc.StatusCode.UNAVAILABLE, _handed_back(what))


def _handed_back(what: str) -> str:
    return f"{what} is draining: stream handed back to the router to migrate"
