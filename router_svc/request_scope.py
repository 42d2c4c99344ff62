"""One client request's lifetime in the router (docs/architecture.md, A request's path): its ids
held in the dispatcher, the in-flight and prompt-token metrics, the wait on ``Router.Abort``, and
the one exit path every ending takes (``Dispatcher.generate`` and the fan-out of n samples,
router_svc/fanout.py, both run inside it).

On exit, the request's status is set from how it ended: DEADLINE_EXCEEDED -> ``"timeout"``, a
client cancel or disconnect (``CancelledError`` / ``GeneratorExit`` of the streaming generator) ->
``"cancelled"``, else whatever the relay set (``Inflight.status``, ``"error"`` by default); the
abort waits are cancelled, the admission ticket closed, legs still open are cancelled with
``Abort`` sent to their workers, the ids released, and the request counted.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Sequence

import grpc

from protos import router_pb2
from router_svc.admission import Ticket
from router_svc.attempts import Inflight
from router_svc.errors import RouterError
from router_svc.validation import PreparedRequest
from telemetry import metrics as M

if TYPE_CHECKING:   # the dispatcher runs its requests in scopes: a type-only import
    from router_svc.dispatch import Dispatcher


class RequestScope:
    """``with RequestScope(dispatcher, prep, ticket=ticket) as scope:`` around one request.

    Args:
        dispatcher: holds the running ids (``reserve`` / ``release``), counts the request, and
            keeps the background Abort tasks of legs closed here.
        prep: the validated request; its ``request_id`` is held first.
        start: the request's arrival (``time.monotonic()`` seconds; default: now), for the e2e
            latency counted on exit.
        ticket: the admission ticket, closed on exit (also when reserving fails).
        extra_ids: more ids held for the request's lifetime (the fan-out's ``<id>#<i>``), each
            with its own handle and abort wait.

    Attributes (after ``__enter__``): ``handles`` / ``waits``, one per id (the request's own id
    first); ``handle`` and ``abort_wait`` are the first of each.

    Raises (on enter):
        RouterError: ALREADY_EXISTS naming an id the tenant already runs; the ids held so far are
            released and the ticket closed, nothing is counted.
    """

    def __init__(self, dispatcher: "Dispatcher", prep: PreparedRequest, start: float | None = None,
                 ticket: Ticket | None = None, extra_ids: Sequence[str] = ()) -> None:
        self._dispatcher = dispatcher
        self.prep = prep
        self.start = start or time.monotonic()
        self.ticket = ticket
        self.ids = [prep.request_id, *extra_ids]
        self.handles: list[Inflight] = []
        self.waits: list[asyncio.Future] = []

    @property
    def handle(self) -> Inflight:
        return self.handles[0]

    @property
    def abort_wait(self) -> asyncio.Future:
        return self.waits[0]

    def aborted_early(self) -> router_pb2.GenerateResponse:
        """The request was aborted before its first token: status ``"cancelled"``, and the answer
        (one per sample) with finish_reason ``abort`` and the prompt's tokens as its usage."""
        self.handle.status = "cancelled"
        return router_pb2.GenerateResponse(request_id=self.prep.request_id, finish_reason="abort",
                                           usage=router_pb2.Usage(prompt_tokens=len(self.prep.input_ids)))

    def __enter__(self) -> "RequestScope":
        tenant = self.prep.tenant
        try:
            for i in self.ids:
                self.handles.append(self._dispatcher.reserve(tenant, i))
        except RouterError:
            for i in self.ids[:len(self.handles)]:
                self._dispatcher.release(tenant, i)
            if self.ticket is not None:
                self.ticket.close()
            raise
        M.ROUTER_IN_FLIGHT.inc()
        M.ROUTER_PROMPT_TOKENS.labels(tenant=tenant).inc(len(self.prep.input_ids))
        self.waits = [asyncio.ensure_future(h.aborted.wait()) for h in self.handles]
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        handle = self.handle
        if isinstance(exc, RouterError) and exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            handle.status = "timeout"
        elif isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            handle.status = "cancelled"
        for w in self.waits:
            w.cancel()
        if self.ticket is not None:
            self.ticket.close()
        if handle.legs is not None and not handle.legs.closed:
            handle.legs.close(abort=True, reason=handle.reason or "client went away",
                              background=self._dispatcher.background)
        for i in self.ids:
            self._dispatcher.release(self.prep.tenant, i)
        M.ROUTER_IN_FLIGHT.dec()
        self._dispatcher.count(handle.status, self.start, self.prep.tenant)
        return False   # the exception, if any, goes on to the caller
