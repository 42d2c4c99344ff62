"""PD dispatch: one client request -> a prefill leg and a decode leg, streamed back
(docs/architecture.md, A request's path).

For each attempt (at most ``max_attempts``, default 2 = "retry once"):

1. pick P with the prefill policy and D with the decode policy (avoiding the workers of a failed
   attempt when others are available), mint a random 63-bit ``room`` (``secrets.randbits(63)``);
   with conditional disaggregation on (``router_svc/local_prefill.py``), a D that holds all but a
   short tail of the prompt may serve it alone: D's call only (``local_prefill``), no P leg;
2. call ``D.Generate(DecodeRequest)`` (server stream) and ``P.Prefill(PrefillRequest)`` (unary)
   **concurrently**, as SMG's ``execute_dual_dispatch_internal`` does: D must not wait for P to
   start pre-allocating, nor P for D to start computing;
3. if either leg fails before D's first chunk, cancel both calls, send ``Abort(request_id, room)``
   to both workers, and retry with a new pair and a new room. Client errors (INVALID_ARGUMENT) are
   returned, not retried;
4. after the first token the D stream is relayed; when D fails (or drains) then, the stream
   migrates to a new pair with prompt + the tokens sent (router_svc/migration.py), up to
   ``migration_limit`` times; beyond it, UNAVAILABLE naming the worker, the tokens sent and the limit.

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
from protos import decode_pb2, router_pb2
from router_svc.admission import Admission, Ticket
from router_svc.api_keys import ANONYMOUS
from router_svc.errors import RouterError
from router_svc.legs import LegFailure, Legs, LocalLeg, code_of, discard
from router_svc.local_prefill import LocalPrefillPolicy
from router_svc.migration import StreamState, migrate_reason
from router_svc.pair_policy import KVPairPolicy
from router_svc.policies import NoWorkerError, Policy
from router_svc.pool import WorkerPool
from router_svc.tokenizer import RouterTokenizer
from router_svc.validation import PreparedRequest
from router_svc.worker import DECODE, PREFILL

log = logging.getLogger("halfmoon.router.dispatch")

# Worker errors that are the client's fault: returned as they are, never retried.
# final statuses of a client request (label `status` of halfmoon_router_requests_total)
REQUEST_STATUSES = M.REQUEST_STATUSES
_CLIENT_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)


@dataclass
class _Inflight:
    """A running client request: ``Router.Abort``'s handle, its current pair and how it ended."""
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""
    legs: "Legs | LocalLeg | None" = None
    status: str = "error"  # label of halfmoon_router_requests_total once it ends


class Dispatcher:
    """Runs client requests over the worker pool.

    Args:
        tok: the served model's tokenizer (detokenization of streamed tokens).
        pool: prefill and decode workers.
        prefill_policy, decode_policy: one policy per role.
        pair_policy: when set (``--policy kv_events``), picks P and D together instead.
        local_prefill: when set, an attempt whose prompt D nearly holds (or whose P's are all busy)
            goes to D alone (conditional disaggregation, ``router_svc.local_prefill``).
        max_attempts: pairs tried per request before failing (2 = retry once).
        first_token_timeout: seconds without any chunk from D (a token or a keepalive of a request
            queued in D) before the first token, after which the attempt fails; the request's
            deadline still bounds the total.
        request_timeout: default deadline (seconds) when the client sets none.
        admission: rate limits and the admission queue bound (default: none).
        tenants: every tenant a request can come from (their metric series exist from the start).
        migration_limit: times a stream may move to another pair after its D failed or drained
            mid-stream (``--migration-limit``; 0 = never: the stream ends with UNAVAILABLE).
    """

    def __init__(self, tok: RouterTokenizer, pool: WorkerPool, prefill_policy: Policy, decode_policy: Policy,
                 max_attempts: int = 2, first_token_timeout: float = 120.0, request_timeout: float = 600.0,
                 admission: Admission | None = None, tenants: tuple[str, ...] = (ANONYMOUS,),
                 pair_policy: KVPairPolicy | None = None, migration_limit: int = 3,
                 local_prefill: LocalPrefillPolicy | None = None) -> None:
        self.tok = tok
        self.pool = pool
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.max_attempts = max_attempts
        self.first_token_timeout = first_token_timeout
        self.request_timeout = request_timeout
        self.pair_policy = pair_policy
        self.migration_limit = migration_limit
        self.local_prefill = local_prefill
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

    def reserve(self, tenant: str, request_id: str) -> _Inflight:
        """Mark ``tenant``'s ``request_id`` running (its :meth:`abort` sets the handle's event); also
        used by the fan-out of n samples (router_svc/fanout.py) for the client's id.

        Raises:
            RouterError: ALREADY_EXISTS naming ``request_id`` when that tenant already runs it.
        """
        key = (tenant, request_id)
        if key in self._inflight:
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request_id!r} is already running",
                              "request_id")
        handle = self._inflight[key] = _Inflight()
        return handle

    def release(self, tenant: str, request_id: str) -> None:
        """Forget a request :meth:`reserve` marked running."""
        self._inflight.pop((tenant, request_id), None)

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
            RouterError: UNAVAILABLE (no worker, or both attempts failed, or D failed mid-stream and
                the stream could not migrate: the message says why, e.g. ``--migration-limit``),
                DEADLINE_EXCEEDED, INVALID_ARGUMENT / RESOURCE_EXHAUSTED from a worker, or
                ALREADY_EXISTS for a request id already running.
        """
        start = arrival or time.monotonic()
        timeout = timeout if timeout is not None else self.request_timeout
        deadline = start + timeout
        rid = prep.request_id
        try:
            handle = self.reserve(prep.tenant, rid)
        except RouterError:
            if ticket is not None:
                ticket.close()
            raise
        M.ROUTER_IN_FLIGHT.inc()
        M.ROUTER_PROMPT_TOKENS.labels(tenant=prep.tenant).inc(len(prep.input_ids))
        legs: Legs | LocalLeg | None = None
        abort_wait = asyncio.ensure_future(handle.aborted.wait())
        try:
            legs, first, attempt = await self._open_pair(prep, handle, abort_wait, deadline, set())
            if first is None:  # aborted before the first token
                handle.status = "cancelled"
                yield router_pb2.GenerateResponse(request_id=rid, finish_reason="abort",
                                                  usage=router_pb2.Usage(prompt_tokens=len(prep.input_ids)))
                return
            if ticket is not None:
                ticket.started()
            state = StreamState(prep, self.migration_limit, retries=attempt)
            async for resp in self._relay(state, legs, first, abort_wait, handle, deadline, start):
                if resp.finish_reason:
                    handle.status = "cancelled" if resp.finish_reason == "abort" else "ok"
                yield resp
        except RouterError as exc:
            if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                handle.status = "timeout"
            raise
        except (asyncio.CancelledError, GeneratorExit):
            handle.status = "cancelled"
            raise
        finally:
            abort_wait.cancel()
            if ticket is not None:
                ticket.close()
            if handle.legs is not None and not handle.legs.closed:
                handle.legs.close(abort=True, reason=handle.reason or "client went away", background=self._background)
            self.release(prep.tenant, rid)
            M.ROUTER_IN_FLIGHT.dec()
            self.count(handle.status, start, prep.tenant)

    async def _open_pair(self, prep: PreparedRequest, handle: _Inflight, abort_wait: asyncio.Future,
                         deadline: float, tried: set[str]) -> tuple[Legs | LocalLeg, decode_pb2.DecodeChunk | None, int]:
        """Pick a pair (avoiding ``tried`` when others are available), start both legs and wait for
        D's first token, retrying on a new pair up to ``max_attempts`` times. Returns (legs, first
        chunk or None when aborted meanwhile (the legs are closed then), attempts - 1); the legs
        are also ``handle.legs``, so that every exit closes them.

        Raises:
            RouterError: as :meth:`generate` (``handle.status`` says how to count it).
        """
        last: LegFailure | None = None
        legs: Legs | LocalLeg | None = None
        for attempt in range(self.max_attempts):
            # n > 1 needs P's n first tokens: D alone samples one (decode_svc/fork.py)
            local = self.local_prefill and prep.best_of == 1 and self.local_prefill.choose(
                self.pool.by_role(PREFILL), self.pool.by_role(DECODE), prep.input_ids, tried)
            try:
                if local:
                    p, d = None, local.decode
                elif self.pair_policy is not None:
                    p, d = self.pair_policy.pick(self.pool.by_role(PREFILL), self.pool.by_role(DECODE),
                                                 prep.input_ids, tried)
                else:
                    p, d = self.pool.pick_pair(self.prefill_policy, self.decode_policy, prep.input_ids, tried)
            except NoWorkerError as exc:
                if last is not None:
                    break
                handle.status = "rejected"
                raise RouterError(grpc.StatusCode.UNAVAILABLE, f"no healthy worker: {exc}") from exc
            room, left = secrets.randbits(63), max(0.001, deadline - time.monotonic())
            legs = handle.legs = LocalLeg(prep, d, room, left) if local else Legs(prep, p, d, room, left)
            picked = {w.worker_id for w in (p, d) if w is not None}
            try:
                first = await self._first_chunk(legs, abort_wait, deadline)
            except LegFailure as f:
                legs.close(abort=True, reason=f"twin leg failed: {f}", background=self._background)
                if f.code not in _CLIENT_CODES + (grpc.StatusCode.RESOURCE_EXHAUSTED,):
                    # which of the two is down? ask both (<= 1 s)
                    await asyncio.gather(*(self.pool.probe(w) for w in (p, d) if w is not None))
                if time.monotonic() >= deadline:
                    handle.status = "timeout"
                    raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline passed: {f}") from None
                if f.code in _CLIENT_CODES:
                    handle.status = "invalid"
                    raise RouterError(f.code, f.detail) from None
                if f.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not any(
                        w.available and w.worker_id not in tried | picked
                        for w in self.pool.by_role(f.leg)):
                    # workers queue while their pool is busy: this one can never hold the
                    # request, and no untried worker of that role is left to ask
                    handle.status = "rejected"
                    raise RouterError(f.code, f"{f.detail} (prompt + max_tokens does not fit any "
                                      f"{f.leg} worker's KV pool)", "max_tokens",
                                      "context_length_exceeded") from None
                log.warning("request %s attempt %d (room %d, %s -> %s) failed before the first token: %s",
                            prep.worker_request_id, attempt + 1, legs.room, p.worker_id if p else "(local)",
                            d.worker_id, f)
                tried |= picked
                last = f
                if attempt + 1 < self.max_attempts:
                    M.ROUTER_RETRIES.labels(leg=f.leg).inc()
                continue
            if first is None:
                legs.close(abort=True, reason=handle.reason, background=self._background)
            return legs, first, attempt
        code = last.code if last and last.code == grpc.StatusCode.RESOURCE_EXHAUSTED else grpc.StatusCode.UNAVAILABLE
        raise RouterError(code, f"request failed after {self.max_attempts} attempts; last: {last}")

    async def open_pair(self, prep: PreparedRequest, handle: _Inflight, abort_wait: asyncio.Future,
                        deadline: float) -> tuple[Legs | LocalLeg, decode_pb2.DecodeChunk | None, int]:
        """One request's pair and D's first chunk, retried as :meth:`generate` does (for the fan-out of
        n samples, router_svc/fanout.py, which relays the chunks itself). Raises RouterError."""
        return await self._open_pair(prep, handle, abort_wait, deadline, set())

    async def _first_chunk(self, legs: Legs | LocalLeg, abort_wait: asyncio.Future, deadline: float):
        """Wait for D's first chunk with tokens; None when aborted. Raises LegFailure: DEADLINE_EXCEEDED
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
                    raise LegFailure(DECODE, legs.d, grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"no first token and no keepalive within {self.first_token_timeout:g} s")
                if legs.p_task in done and legs.p_result is None:
                    exc = legs.p_task.exception() if not legs.p_task.cancelled() else asyncio.CancelledError()
                    if exc is not None:
                        raise LegFailure(PREFILL, legs.p, *code_of(exc))
                    legs.p_result = legs.p_task.result()
                if read in done:
                    exc = read.exception() if not read.cancelled() else asyncio.CancelledError()
                    if exc is not None:
                        raise LegFailure(DECODE, legs.d, *code_of(exc))
                    chunk = read.result()
                    if chunk is grpc.aio.EOF:
                        raise LegFailure(DECODE, legs.d, grpc.StatusCode.UNAVAILABLE,
                                          "stream ended before the first token")
                    if chunk.token_ids:
                        return chunk
                    if chunk.finish_reason:
                        raise LegFailure(DECODE, legs.d, grpc.StatusCode.ABORTED,
                                          f"finished with {chunk.finish_reason!r} before the first token")
                    # D's keepalive (the request is queued there): a sign of life restarts the timer
                    wait_until = min(deadline, time.monotonic() + self.first_token_timeout)
                    read = legs.read()
        finally:
            discard(read)

    async def _relay(self, state: StreamState, legs: Legs | LocalLeg, first: decode_pb2.DecodeChunk,
                     abort_wait: asyncio.Future, handle: _Inflight, deadline: float,
                     start: float) -> AsyncIterator[router_pb2.GenerateResponse]:
        prep = state.prep
        rid = prep.request_id
        detok = IncrementalDetokenizer(self.tok.backend, prep.input_ids, prep.stop)
        chunk = first
        last_emit = None
        while True:
            meta = dict(request_id=rid, prefill_worker=legs.p.worker_id if legs.p else "",
                        decode_worker=legs.d.worker_id)
            if chunk is None:
                read = legs.read()
                try:
                    done, _ = await asyncio.wait({read, abort_wait}, timeout=max(0.0, deadline - time.monotonic()),
                                                 return_when=asyncio.FIRST_COMPLETED)
                finally:
                    # the client's deadline cancels this handler while D's call, bound by the same
                    # deadline, may already have failed: the read's exception must still be retrieved
                    discard(read)
                if abort_wait in done or not done:
                    if not done:
                        raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                          f"deadline passed after {state.n_tokens} tokens")
                    legs.close(abort=True, reason=handle.reason, background=self._background)
                    yield router_pb2.GenerateResponse(text=detok.flush(), finish_reason="abort",
                                                      usage=state.finish(legs.p_done()), **meta)
                    return
                exc = read.exception() if not read.cancelled() else asyncio.CancelledError()
                chunk = read.result() if exc is None else None
                if exc is not None or chunk is grpc.aio.EOF:
                    legs, chunk = await self._migrate(state, legs, exc, abort_wait, handle, deadline)
                    if chunk is None:  # aborted while a new pair was found
                        yield router_pb2.GenerateResponse(text=detok.flush(), finish_reason="abort",
                                                          usage=state.finish(None), request_id=rid)
                        return
                    continue
                if not chunk.token_ids and not chunk.finish_reason:
                    # D sends keepalives only before the first token; an empty chunk is never relayed
                    chunk = None
                    continue
            token_ids, logprobs, text = _detokenize(detok, chunk)
            state.add(chunk, token_ids)
            finish = chunk.finish_reason
            matched = chunk.matched_stop
            if detok.stopped:
                finish, matched = "stop", detok.stop_reason
            if finish:
                text += detok.flush(matched or None)
                matched = detok.stop_reason or matched
                if not chunk.finish_reason:  # the router saw the stop string first: D still runs
                    legs.close(abort=True, reason="stop string matched", background=self._background)
                else:
                    legs.close(abort=False, reason="", background=self._background)
            resp = router_pb2.GenerateResponse(token_ids=token_ids, text=text, logprobs=logprobs,
                                               finish_reason=finish, matched_stop=matched or "", **meta)
            if finish:
                resp.usage.CopyFrom(state.finish(legs.p_done()))
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

    async def _migrate(self, state: StreamState, legs: Legs | LocalLeg, exc: BaseException | None,
                       abort_wait: asyncio.Future, handle: _Inflight,
                       deadline: float) -> tuple[Legs | LocalLeg, decode_pb2.DecodeChunk | None]:
        """D's stream broke after tokens were sent (``exc``; None: it ended without a finish reason):
        continue on a new pair (router_svc/migration.py). Returns the new legs and their first chunk
        (None when the request was aborted meanwhile).

        Raises:
            RouterError: UNAVAILABLE naming the worker and why the stream was not migrated (the
                limit, the request's kind, no pair left), DEADLINE_EXCEEDED.
        """
        code, detail = code_of(exc) if exc is not None else (grpc.StatusCode.UNAVAILABLE, "stream ended without a finish reason")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() >= deadline:
            raise RouterError(code, f"deadline passed after {state.n_tokens} tokens")
        reason = migrate_reason(exc)
        failed = legs.d
        legs.close(abort=True, reason=f"migrating: {code.name}: {detail}", background=self._background)
        what = (f"decode worker {failed.worker_id} ({failed.address}) failed after {state.n_tokens} tokens "
                f"were sent: {code.name}: {detail}")
        if reason != "drain":
            # down, or its peer? the answer also keeps it out of the next pick
            await self.pool.probe(failed)
        why = state.refusal(code)
        if why:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"{what}; {why}")
        if state.n_tokens >= state.prep.sampling.max_tokens:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"{what}; it had sent every token but not its finish")
        state.seam(legs.p_done())
        M.ROUTER_MIGRATIONS.labels(reason=reason).inc()
        log.warning("request %s: %s; migrating (%d of --migration-limit %d)", state.prep.worker_request_id,
                    what, state.migrations, state.limit)
        try:
            new, first, _ = await self._open_pair(state.continuation(), handle, abort_wait, deadline,
                                                  {failed.worker_id})
        except RouterError as e:
            raise RouterError(e.code, f"{what}; migration failed: {e.message}", e.param, e.err_code) from None
        return new, first


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
