"""``halfmoon.v1.Router`` gRPC servicer: Generate (server stream), Abort, ListModels, ListWorkers."""

from __future__ import annotations

import contextvars
import logging
import time

from grpc._cython.cygrpc import ExecuteBatchError

from protos import common_pb2, router_pb2, router_pb2_grpc
from router_svc.dispatch import Dispatcher
from router_svc.errors import RouterError
from router_svc.fanout import generate_n
from router_svc.grpc_auth import current_tenant
from router_svc.validation import prepare

log = logging.getLogger("halfmoon.router.grpc")

# the servicer context of the Generate call this task runs, for SendAfterDeadlineFilter
_CALL: contextvars.ContextVar = contextvars.ContextVar("halfmoon_router_call")


class SendAfterDeadlineFilter(logging.Filter):
    """For grpc.aio's logger: a send that fails in core is logged at ERROR with a traceback unless
    grpc.aio has already seen the call's cancellation, and at the client's deadline the two race (a
    stream whose last message or status goes out at that instant). A failed send on a call whose
    deadline has passed is that deadline, not an error: logged at DEBUG instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _CALL.get(None)
        if (ctx is None or not record.exc_info or not isinstance(record.exc_info[1], ExecuteBatchError)
                or ctx.time_remaining() != 0):
            return True
        log.debug("send after the client's deadline failed: %s", record.getMessage())
        return False


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Validates, then streams :meth:`Dispatcher.generate`; errors become gRPC statuses.

    The client's deadline (``context.time_remaining()``) bounds both legs; a cancelled call
    (client cancel / disconnect / deadline) cancels the handler, and the dispatcher aborts both legs.
    ``n`` / ``best_of`` > 1 run through :func:`~router_svc.fanout.generate_n`.
    The caller's tenant comes from :class:`~router_svc.grpc_auth.AioApiKeyInterceptor`; request ids
    (Generate, Abort) are the tenant's own.
    """

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.d = dispatcher

    async def Generate(self, request, context):
        arrival = time.monotonic()
        _CALL.set(context)
        tenant = current_tenant()
        try:
            ticket = self.d.admit(tenant, arrival)
        except RouterError as exc:
            await _abort(context, exc)
        try:
            prep = prepare(request, self.d.tok, tenant=tenant)
        except RouterError as exc:
            ticket.close()
            self.d.count("invalid", arrival, tenant)
            await _abort(context, exc)
        try:
            if prep.best_of == 1:
                async for resp in self.d.generate(prep, timeout=context.time_remaining(), arrival=arrival,
                                                  ticket=ticket):
                    yield resp
            else:  # n / best_of: every message says its sample's index
                async for index, resp in generate_n(self.d, prep, timeout=context.time_remaining(), arrival=arrival,
                                                    ticket=ticket):
                    resp.index = index
                    yield resp
        except RouterError as exc:
            await _abort(context, exc)

    async def Abort(self, request: common_pb2.AbortRequest, context):
        return common_pb2.AbortResponse(found=self.d.abort(request.request_id, request.reason or "aborted by client",
                                                           tenant=current_tenant()))

    async def ListModels(self, request, context):
        card = self.d.tok.card
        return router_pb2.ListModelsResponse(models=[router_pb2.ModelInfo(id=card.id, max_context=card.max_context)])

    async def ListWorkers(self, request, context):
        out = router_pb2.ListWorkersResponse()
        for w in sorted(self.d.pool.workers.values(), key=lambda w: (w.role, w.worker_id)):
            ws = out.workers.add(worker_id=w.worker_id, role=w.role, address=w.address, healthy=w.available,
                                 inflight=w.inflight)
            if w.load is not None:
                ws.load.CopyFrom(w.load)
        return out


async def _abort(context, exc: RouterError) -> None:
    trailers = exc.grpc_trailers()
    if trailers:
        context.set_trailing_metadata(trailers)
    await context.abort(exc.code, exc.message)


__all__ = ["RouterServicer", "SendAfterDeadlineFilter"]
