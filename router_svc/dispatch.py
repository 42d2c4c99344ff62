"""PD dispatch: one client request -> a prefill leg and a decode leg, streamed back
(docs/architecture.md, A request's path).

For each attempt (at most ``max_attempts``, default 2 = "retry once"):

1. pick P with the prefill policy and D with the decode policy (avoiding the workers of a failed
   attempt when others are available), mint a random 63-bit ``room`` (``secrets.randbits(63)``);
2. call ``D.Generate(DecodeRequest)`` (server stream) and ``P.Prefill(PrefillRequest)`` (unary)
   **concurrently**, as SMG's ``execute_dual_dispatch_internal`` does: D must not wait for P to
   start pre-allocating, nor P for D to start computing;
3. if either leg fails before D's first chunk, cancel both calls, send ``Abort(request_id, room)``
   to both workers, and retry with a new pair and a new room. Client errors (INVALID_ARGUMENT) are
   returned, not retried;
4. after the first token the D stream is relayed; a D failure then ends the request with
   UNAVAILABLE naming the worker and the tokens already sent.

Client cancel, disconnect, deadline, ``Router.Abort`` and a stop string seen by the router all
cancel the calls and send ``Abort`` to both legs. Every exit path goes through one ``finally``.

Request ids are scoped per tenant: running requests are keyed by ``(tenant, request_id)``, so
``Router.Abort`` and the ALREADY_EXISTS check reach only the caller's own requests, and workers get
``PreparedRequest.worker_request_id`` (``<tenant>/<id>``), unique across tenants.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from engine.detokenizer import IncrementalDetokenizer
from telemetry import metrics as M
from protos import common_pb2, decode_pb2, prefill_pb2, router_pb2
from router_svc.admission import Admission, Ticket
from router_svc.api_keys import ANONYMOUS
from router_svc.errors import RouterError
from router_svc.pair_policy import KVPairPolicy
from router_svc.policies import NoWorkerError, Policy
from router_svc.pool import WorkerPool
from router_svc.tokenizer import RouterTokenizer
from router_svc.validation import PreparedRequest
from router_svc.worker import DECODE, PREFILL, Worker

log = logging.getLogger("halfmoon.router.dispatch")

# Worker errors that are the client's fault: returned as they are, never retried.
# final statuses of a client request (label `status` of halfmoon_router_requests_total)
REQUEST_STATUSES = M.REQUEST_STATUSES
_CLIENT_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)


class _LegFailure(Exception):
    def __init__(self, leg: str, worker: Worker, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(f"{leg} worker {worker.worker_id} ({worker.address}): {code.name}: {detail}")
        self.leg, self.worker, self.code, self.detail = leg, worker, code, detail


@dataclass
class _Inflight:
    """A running client request, for ``Router.Abort``."""
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""


class _Legs:
    """The two concurrent calls of one attempt."""

    def __init__(self, prep: PreparedRequest, p: Worker, d: Worker, room: int, timeout: float | None) -> None:
        self.prep, self.p, self.d, self.room = prep, p, d, room
        dreq = decode_pb2.DecodeRequest(request_id=prep.worker_request_id, room=room, input_ids=prep.input_ids,
                                        sampling=prep.sampling, prefill_address=p.address,
                                        prefill_worker_id=p.worker_id)
        preq = prefill_pb2.PrefillRequest(request_id=prep.worker_request_id, room=room, input_ids=prep.input_ids,
                                          sampling=prep.sampling)
        self.d_call = d.stub.Generate(dreq, timeout=timeout)
        self.p_task: asyncio.Task = asyncio.ensure_future(p.stub.Prefill(preq, timeout=timeout))
        self.p_result: prefill_pb2.PrefillResult | None = None
        p.inflight += 1
        d.inflight += 1
        self.closed = False

    def read(self) -> asyncio.Task:
        return asyncio.ensure_future(self.d_call.read())

    def close(self, abort: bool, reason: str, background: set) -> None:
        """Cancel what still runs; with ``abort``, also send Abort(request_id, room) to both legs."""
        if self.closed:
            return
        self.closed = True
        self.p.inflight -= 1
        self.d.inflight -= 1
        self.d_call.cancel()
        _discard(self.p_task)
        if abort:
            req = common_pb2.AbortRequest(request_id=self.prep.worker_request_id, room=self.room, reason=reason)
            for w in (self.d, self.p):
                t = asyncio.ensure_future(_abort_leg(w, req))
                background.add(t)
                t.add_done_callback(background.discard)


def _discard(task: asyncio.Future) -> None:
    """Cancel a pending leg task, or mark a finished one's exception as seen: both legs can fail in the
    same wait (P refuses the pair, D reports "prefill failed"), and an exception nobody retrieved is
    logged by asyncio as "Task exception was never retrieved" with a traceback."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


async def _abort_leg(w: Worker, req: common_pb2.AbortRequest) -> None:
    try:
        await w.stub.Abort(req, timeout=5.0)
    except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.CancelledError) as exc:
        # UsageError: the worker was removed from the pool meanwhile and its channel closed
        log.debug("Abort to %s failed: %s", w.worker_id, exc)


def _code_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.UNKNOWN, repr(exc)


class Dispatcher:
    """Runs client requests over the worker pool.

    Args:
        tok: the served model's tokenizer (detokenization of streamed tokens).
        pool: prefill and decode workers.
        prefill_policy, decode_policy: one policy per role.
        pair_policy: when set (``--policy kv_events``), picks P and D together instead.
        max_attempts: pairs tried per request before failing (2 = retry once).
        first_token_timeout: seconds without any chunk from D (a token or a keepalive of a request
            queued in D) before the first token, after which the attempt fails; the request's
            deadline still bounds the total.
        request_timeout: default deadline (seconds) when the client sets none.
        admission: rate limits and the admission queue bound (default: none).
        tenants: every tenant a request can come from (their metric series exist from the start).
    """

    def __init__(self, tok: RouterTokenizer, pool: WorkerPool, prefill_policy: Policy, decode_policy: Policy,
                 max_attempts: int = 2, first_token_timeout: float = 120.0, request_timeout: float = 600.0,
                 admission: Admission | None = None, tenants: tuple[str, ...] = (ANONYMOUS,),
                 pair_policy: KVPairPolicy | None = None) -> None:
        self.tok = tok
        self.pool = pool
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.max_attempts = max_attempts
        self.first_token_timeout = first_token_timeout
        self.request_timeout = request_timeout
        self.pair_policy = pair_policy
        pool.policies = [prefill_policy, decode_policy]
        self.policy_label = pair_policy.name if pair_policy else f"{prefill_policy.name}/{decode_policy.name}"
        self.admission = admission or Admission()
        M.init_router_series(self.policy_label, tenants, REQUEST_STATUSES)
        self._inflight: dict[tuple[str, str], _Inflight] = {}
        self._background: set = set()

    def abort(self, request_id: str, reason: str = "aborted by client", tenant: str = ANONYMOUS) -> bool:
        """Abort ``tenant``'s running request ``request_id`` (``Router.Abort``); False when that tenant
        runs none with that id (another tenant's request of the same id is not touched)."""
        h = self._inflight.get((tenant, request_id))
        if h is None:
            return False
        h.reason = reason
        h.aborted.set()
        return True

    def count(self, status: str, start: float, tenant: str = ANONYMOUS) -> None:
        assert status in REQUEST_STATUSES, status
        M.ROUTER_REQUESTS.labels(status=status, policy=self.policy_label, tenant=tenant).inc()
        M.ROUTER_E2E.labels(tenant=tenant).observe(time.monotonic() - start)

    def admit(self, tenant: str, arrival: float) -> Ticket:
        """Admission of one generation request (before validation): see :class:`Admission`.

        Raises:
            RouterError: RESOURCE_EXHAUSTED with ``retry_after`` (rate limit, queue full), counted.
        """
        try:
            return self.admission.admit(tenant)
        except RouterError as exc:
            self.count("queue_full" if exc.err_code == "queue_full" else "rate_limited", arrival, tenant)
            raise

    async def generate(self, prep: PreparedRequest, timeout: float | None = None, arrival: float | None = None,
                       ticket: Ticket | None = None) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Stream responses for a validated request; ``ticket`` (from :meth:`admit`) leaves the
        admission queue at the first token and is closed at the end in any case.

        Yields GenerateResponse messages: token ids, text delta (UTF-8 safe, stop strings removed),
        logprobs; the last one carries ``finish_reason`` ("stop" | "length" | "abort") and usage.

        Raises:
            RouterError: UNAVAILABLE (no worker, or both attempts failed, or D died mid-stream),
                DEADLINE_EXCEEDED, INVALID_ARGUMENT / RESOURCE_EXHAUSTED from a worker, or
                ALREADY_EXISTS for a request id already running.
        """
        start = arrival or time.monotonic()
        timeout = timeout if timeout is not None else self.request_timeout
        deadline = start + timeout
        rid = prep.request_id
        key = (prep.tenant, rid)
        if key in self._inflight:
            if ticket is not None:
                ticket.close()
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is already running", "request_id")
        handle = _Inflight()
        self._inflight[key] = handle
        M.ROUTER_IN_FLIGHT.inc()
        M.ROUTER_PROMPT_TOKENS.labels(tenant=prep.tenant).inc(len(prep.input_ids))
        status = "error"
        legs: _Legs | None = None
        abort_wait = asyncio.ensure_future(handle.aborted.wait())
        try:
            tried: set[str] = set()
            last: _LegFailure | None = None
            first = None
            attempt = 0
            for attempt in range(self.max_attempts):
                try:
                    if self.pair_policy is not None:
                        p, d = self.pair_policy.pick(self.pool.by_role(PREFILL), self.pool.by_role(DECODE),
                                                     prep.input_ids, tried)
                    else:
                        p, d = self.pool.pick_pair(self.prefill_policy, self.decode_policy, prep.input_ids, tried)
                except NoWorkerError as exc:
                    if last is not None:
                        break
                    status = "rejected"
                    raise RouterError(grpc.StatusCode.UNAVAILABLE, f"no healthy worker: {exc}") from exc
                legs = _Legs(prep, p, d, secrets.randbits(63), max(0.001, deadline - time.monotonic()))
                try:
                    first = await self._first_chunk(legs, abort_wait, deadline)
                except _LegFailure as f:
                    legs.close(abort=True, reason=f"twin leg failed: {f}", background=self._background)
                    if f.code not in _CLIENT_CODES + (grpc.StatusCode.RESOURCE_EXHAUSTED,):
                        # which of the two is down? ask both (<= 1 s)
                        await asyncio.gather(self.pool.probe(p), self.pool.probe(d))
                    if time.monotonic() >= deadline:
                        status = "timeout"
                        raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline passed: {f}") from None
                    if f.code in _CLIENT_CODES:
                        status = "invalid"
                        raise RouterError(f.code, f.detail) from None
                    if f.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not any(
                            w.available and w.worker_id not in tried | {p.worker_id, d.worker_id}
                            for w in self.pool.by_role(f.leg)):
                        # workers queue while their pool is busy: this one can never hold the
                        # request, and no untried worker of that role is left to ask
                        status = "rejected"
                        raise RouterError(f.code, f"{f.detail} (prompt + max_tokens does not fit any "
                                          f"{f.leg} worker's KV pool)", "max_tokens",
                                          "context_length_exceeded") from None
                    log.warning("request %s attempt %d (room %d, %s -> %s) failed before the first token: %s",
                                prep.worker_request_id, attempt + 1, legs.room, p.worker_id, d.worker_id, f)
                    tried |= {p.worker_id, d.worker_id}
                    last = f
                    if attempt + 1 < self.max_attempts:
                        M.ROUTER_RETRIES.labels(leg=f.leg).inc()
                    continue
                break
            if first is None and legs is not None and not legs.closed:  # aborted before the first token
                legs.close(abort=True, reason=handle.reason, background=self._background)
                status = "cancelled"
                yield router_pb2.GenerateResponse(request_id=rid, finish_reason="abort",
                                                  usage=router_pb2.Usage(prompt_tokens=len(prep.input_ids)))
                return
            if ticket is not None:
                ticket.started()
            if first is None:
                code = last.code if last and last.code == grpc.StatusCode.RESOURCE_EXHAUSTED else grpc.StatusCode.UNAVAILABLE
                raise RouterError(code, f"request failed after {self.max_attempts} attempts; last: {last}")
            async for resp in self._relay(prep, legs, first, abort_wait, handle, deadline, start, attempt):
                if resp.finish_reason:
                    status = "cancelled" if resp.finish_reason == "abort" else "ok"
                yield resp
        except RouterError as exc:
            if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                status = "timeout"
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        finally:
            abort_wait.cancel()
            if ticket is not None:
                ticket.close()
            if legs is not None and not legs.closed:
                legs.close(abort=True, reason=handle.reason or "client went away", background=self._background)
            self._inflight.pop(key, None)
            M.ROUTER_IN_FLIGHT.dec()
            self.count(status, start, prep.tenant)

    async def _first_chunk(self, legs: _Legs, abort_wait: asyncio.Future, deadline: float):
        """Wait for D's first chunk with tokens; None when aborted. Raises _LegFailure: DEADLINE_EXCEEDED
        when D sent nothing (no token, no keepalive) for ``first_token_timeout`` s."""
        read = legs.read()
        wait_until = min(deadline, time.monotonic() + self.first_token_timeout)
        try:
            while True:
                pending = {read, abort_wait} | ({legs.p_task} if legs.p_result is None else set())
                done, _ = await asyncio.wait(pending, timeout=max(0.0, wait_until - time.monotonic()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if abort_wait in done:
                    return None
                if not done:
                    if time.monotonic() >= deadline:
                        raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the first token")
                    raise _LegFailure(DECODE, legs.d, grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"no first token and no keepalive within {self.first_token_timeout:g} s")
                if legs.p_task in done and legs.p_result is None:
                    exc = legs.p_task.exception() if not legs.p_task.cancelled() else asyncio.CancelledError()
                    if exc is not None:
                        raise _LegFailure(PREFILL, legs.p, *_code_of(exc))
                    legs.p_result = legs.p_task.result()
                if read in done:
                    exc = read.exception() if not read.cancelled() else asyncio.CancelledError()
                    if exc is not None:
                        raise _LegFailure(DECODE, legs.d, *_code_of(exc))
                    chunk = read.result()
                    if chunk is grpc.aio.EOF:
                        raise _LegFailure(DECODE, legs.d, grpc.StatusCode.UNAVAILABLE,
                                          "stream ended before the first token")
                    if chunk.token_ids:
                        return chunk
                    if chunk.finish_reason:
                        raise _LegFailure(DECODE, legs.d, grpc.StatusCode.ABORTED,
                                          f"finished with {chunk.finish_reason!r} before the first token")
                    # D's keepalive (the request is queued there): a sign of life restarts the timer
                    wait_until = min(deadline, time.monotonic() + self.first_token_timeout)
                    read = legs.read()
        finally:
            _discard(read)

    async def _relay(self, prep: PreparedRequest, legs: _Legs, first: decode_pb2.DecodeChunk,
                     abort_wait: asyncio.Future, handle: _Inflight, deadline: float, start: float,
                     retries: int) -> AsyncIterator[router_pb2.GenerateResponse]:
        rid = prep.request_id
        detok = IncrementalDetokenizer(self.tok.backend, prep.input_ids, prep.stop)
        usage = router_pb2.Usage(prompt_tokens=len(prep.input_ids), retries=retries)
        meta = dict(request_id=rid, prefill_worker=legs.p.worker_id, decode_worker=legs.d.worker_id)
        chunk = first
        n_tokens = 0
        last_emit = None
        while True:
            if chunk is None:
                read = legs.read()
                try:
                    done, _ = await asyncio.wait({read, abort_wait}, timeout=max(0.0, deadline - time.monotonic()),
                                                 return_when=asyncio.FIRST_COMPLETED)
                finally:
                    # the client's deadline cancels this handler while D's call, bound by the same
                    # deadline, may already have failed: the read's exception must still be retrieved
                    _discard(read)
                if abort_wait in done or not done:
                    if not done:
                        raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                          f"deadline passed after {n_tokens} tokens")
                    legs.close(abort=True, reason=handle.reason, background=self._background)
                    usage.completion_tokens = n_tokens
                    yield router_pb2.GenerateResponse(text=detok.flush(), finish_reason="abort", usage=usage, **meta)
                    return
                exc = read.exception() if not read.cancelled() else asyncio.CancelledError()
                chunk = read.result() if exc is None else None
                if exc is not None or chunk is grpc.aio.EOF:
                    code, detail = _code_of(exc) if exc is not None else (grpc.StatusCode.UNAVAILABLE, "stream ended without a finish reason")
                    if code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() >= deadline:
                        raise RouterError(code, f"deadline passed after {n_tokens} tokens")
                    if code == grpc.StatusCode.UNAVAILABLE:
                        probe = asyncio.ensure_future(self.pool.probe(legs.d))
                        self._background.add(probe)
                        probe.add_done_callback(self._background.discard)
                    raise RouterError(grpc.StatusCode.UNAVAILABLE,
                                      f"decode worker {legs.d.worker_id} ({legs.d.address}) failed after {n_tokens} "
                                      f"tokens were sent: {code.name}: {detail}")
                if not chunk.token_ids and not chunk.finish_reason:
                    # D sends keepalives only before the first token; an empty chunk is never relayed
                    chunk = None
                    continue
            _merge_usage(usage, chunk)
            token_ids, logprobs, text = _detokenize(detok, chunk)
            n_tokens += len(token_ids)
            finish = chunk.finish_reason
            matched = chunk.matched_stop
            if detok.stopped:
                finish, matched = "stop", detok.stop_reason
            if finish:
                text += detok.flush(matched or None)
                matched = detok.stop_reason or matched
                _finish_usage(usage, legs, n_tokens, chunk)
                if not chunk.finish_reason:  # the router saw the stop string first: D still runs
                    legs.close(abort=True, reason="stop string matched", background=self._background)
                else:
                    legs.close(abort=False, reason="", background=self._background)
            resp = router_pb2.GenerateResponse(token_ids=token_ids, text=text, logprobs=logprobs,
                                               finish_reason=finish, matched_stop=matched or "", **meta)
            if finish:
                resp.usage.CopyFrom(usage)
            now = time.monotonic()
            if token_ids:
                if last_emit is None:
                    M.ROUTER_TTFT.labels(tenant=prep.tenant).observe(now - start)
                else:
                    gap = (now - last_emit) / len(token_ids)
                    itl = M.ROUTER_ITL.labels(tenant=prep.tenant)
                    for _ in token_ids:
                        itl.observe(gap)
                last_emit = now
                M.ROUTER_COMPLETION_TOKENS.labels(tenant=prep.tenant).inc(len(token_ids))
            yield resp
            if finish:
                return
            chunk = None


def _detokenize(detok: IncrementalDetokenizer, chunk: decode_pb2.DecodeChunk) -> tuple[Sequence, Sequence, str]:
    """(token ids, logprobs, text) of a D chunk, cut after the token that completes a stop string:
    D sends several tokens in one chunk when its stream lagged, and tokens past a stop string that
    only the router matched are not the client's."""
    ids, parts = chunk.token_ids, []
    for k, t in enumerate(ids):
        parts.append(detok.add(t))
        if detok.stopped:
            return list(ids[:k + 1]), list(chunk.logprobs[:k + 1]), "".join(parts)
    return ids, chunk.logprobs, "".join(parts)


def _merge_usage(usage: router_pb2.Usage, chunk: decode_pb2.DecodeChunk) -> None:
    """D sets the accounting fields on its first and last chunks; keep the non-zero ones."""
    if chunk.cached_tokens:
        usage.cached_tokens = chunk.cached_tokens
    if chunk.decode_prefix_tokens:
        usage.decode_prefix_tokens = chunk.decode_prefix_tokens
    if chunk.kv_pages_transferred:
        usage.kv_pages_transferred = chunk.kv_pages_transferred
    if chunk.kv_bytes_transferred:
        usage.kv_bytes_transferred = chunk.kv_bytes_transferred


def _finish_usage(usage: router_pb2.Usage, legs: _Legs, n_tokens: int, last: decode_pb2.DecodeChunk) -> None:
    usage.completion_tokens = n_tokens
    r = legs.p_result
    if r is None and legs.p_task.done() and not legs.p_task.cancelled() and legs.p_task.exception() is None:
        r = legs.p_task.result()
    if r is not None:  # P's own numbers, when D did not forward them
        usage.cached_tokens = usage.cached_tokens or r.cached_tokens
        usage.kv_pages_transferred = usage.kv_pages_transferred or r.pages_sent
        usage.kv_bytes_transferred = usage.kv_bytes_transferred or r.bytes_sent
    usage.cached_tokens = max(0, min(usage.cached_tokens, usage.prompt_tokens))
