"""The calls of one attempt (docs/architecture.md, A request's path, step 1): D's ``Generate`` stream
and P's ``Prefill`` concurrently (``Legs``), or D's call alone when D prefills the prompt itself
(``LocalLeg``); the failure of either leg, and their cancel + ``Abort``.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod

import grpc

from protos import common_pb2, decode_pb2, prefill_pb2
from router_svc.validation import PreparedRequest
from router_svc.worker import Worker

log = logging.getLogger("halfmoon.router.dispatch")


class LegFailure(Exception):
    def __init__(self, leg: str, worker: Worker, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(f"{leg} worker {worker.worker_id} ({worker.address}): {code.name}: {detail}")
        self.leg, self.worker, self.code, self.detail = leg, worker, code, detail


class DecodeCall(ABC):
    """What every attempt has: D's ``Generate`` stream (``d_call``), counted in the workers'
    ``inflight`` until :meth:`close`; subclasses add P's leg, or none."""

    def __init__(self, prep: PreparedRequest, d: Worker, room: int, dreq: decode_pb2.DecodeRequest,
                 timeout: float | None) -> None:
        self.prep, self.d, self.room = prep, d, room
        self.d_call = d.stub.Generate(dreq, timeout=timeout)
        d.inflight += 1
        self.closed = False

    @abstractmethod
    def p_done(self) -> prefill_pb2.PrefillResult | None:
        """P's answer, once known."""

    def workers(self) -> tuple[Worker, ...]:
        """The workers this attempt calls (each sent ``Abort`` by :meth:`close`)."""
        return (self.d,)

    def read(self) -> asyncio.Task:
        return asyncio.ensure_future(self.d_call.read())

    def close(self, abort: bool, reason: str, background: set) -> None:
        """Cancel what still runs; with ``abort``, also send Abort(request_id, room) to every leg."""
        if self.closed:
            return
        self.closed = True
        for w in self.workers():
            w.inflight -= 1
        self.d_call.cancel()
        self._cancel_others()
        if abort:
            send_aborts(self.prep, self.room, reason, self.workers(), background)

    def _cancel_others(self) -> None:
        """Cancel the calls besides D's (none here)."""


class Legs(DecodeCall):
    """The two concurrent calls of one attempt."""

    def __init__(self, prep: PreparedRequest, p: Worker, d: Worker, room: int, timeout: float | None) -> None:
        dreq = decode_pb2.DecodeRequest(request_id=prep.worker_request_id, room=room, input_ids=prep.input_ids,
                                        sampling=prep.sampling, prefill_address=p.address,
                                        prefill_worker_id=p.worker_id, n=prep.best_of)
        super().__init__(prep, d, room, dreq, timeout)
        self.p = p
        # best_of samples: one prefill, n first tokens, D forks (router_svc/fanout.py)
        preq = prefill_pb2.PrefillRequest(request_id=prep.worker_request_id, room=room, input_ids=prep.input_ids,
                                          sampling=prep.sampling, n=prep.best_of)
        self.p_task: asyncio.Task = asyncio.ensure_future(p.stub.Prefill(preq, timeout=timeout))
        self.p_result: prefill_pb2.PrefillResult | None = None
        p.inflight += 1

    def p_done(self) -> prefill_pb2.PrefillResult | None:
        """P's answer, when its call already succeeded."""
        if self.p_result is None and self.p_task.done() and not self.p_task.cancelled() \
                and self.p_task.exception() is None:
            self.p_result = self.p_task.result()
        return self.p_result

    def workers(self) -> tuple[Worker, ...]:
        return (self.d, self.p)

    def _cancel_others(self) -> None:
        discard(self.p_task)


class LocalLeg(DecodeCall):
    """One attempt with a decode leg only (``DecodeRequest.local_prefill``, router_svc/local_prefill.py):
    the interface of :class:`Legs` with ``p`` None and ``p_result`` an empty ``PrefillResult`` (P
    computed and sent nothing, so usage keeps D's numbers)."""

    def __init__(self, prep: PreparedRequest, d: Worker, room: int, timeout: float | None) -> None:
        dreq = decode_pb2.DecodeRequest(request_id=prep.worker_request_id, room=room, input_ids=prep.input_ids,
                                        sampling=prep.sampling, local_prefill=True)
        super().__init__(prep, d, room, dreq, timeout)
        self.p = None
        self.p_task: asyncio.Future | None = None
        self.p_result = prefill_pb2.PrefillResult()

    def p_done(self) -> prefill_pb2.PrefillResult:
        """P's answer: always the empty result (no P leg)."""
        return self.p_result


def send_aborts(prep: PreparedRequest, room: int, reason: str, workers, background: set,
                sample: int | None = None) -> None:
    """Abort(request_id, room) to each of ``workers`` in the background (tasks kept in ``background``
    until done); ``sample``: only that sample of an n > 1 request (decode workers)."""
    req = common_pb2.AbortRequest(request_id=prep.worker_request_id, room=room, reason=reason, sample=sample)
    for w in workers:
        t = asyncio.ensure_future(abort_leg(w, req))
        background.add(t)
        t.add_done_callback(background.discard)


def discard(task: asyncio.Future) -> None:
    """Cancel a pending leg task, or mark a finished one's exception as seen: both legs can fail in the
    same wait (P refuses the pair, D reports "prefill failed"), and an exception nobody retrieved is
    logged by asyncio as "Task exception was never retrieved" with a traceback."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


async def abort_leg(w: Worker, req: common_pb2.AbortRequest) -> None:
    try:
        await w.stub.Abort(req, timeout=5.0)
    except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.CancelledError) as exc:
        # UsageError: the worker was removed from the pool meanwhile and its channel closed
        log.debug("Abort to %s failed: %s", w.worker_id, exc)


def code_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.UNKNOWN, repr(exc)
