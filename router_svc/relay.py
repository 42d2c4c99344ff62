"""After a request's first token: relay D's stream to the client (detokenized, stop strings cut,
latencies counted), and migrate it to a new pair when D fails or drains mid-stream
(router_svc/migration.py; docs/architecture.md, A request's path).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import AsyncIterator

import grpc

from engine.detokenizer import IncrementalDetokenizer
from telemetry import metrics as M
from protos import decode_pb2, router_pb2
from router_svc.attempts import Attempts, Inflight
from router_svc.errors import RouterError
from router_svc.legs import Legs, LocalLeg, code_of, discard
from router_svc.migration import StreamState, migrate_reason
from router_svc.pool import WorkerPool
from router_svc.tokenizer import RouterTokenizer

log = logging.getLogger("halfmoon.router.dispatch")


class Relay:
    """Streams one request's responses once its first chunk is in.

    Args:
        tok: the served model's tokenizer (detokenization of streamed tokens).
        pool: the worker pool (a failed D is probed before migrating).
        attempts: opens the new pair of a migration.
        background: the dispatcher's set of background Abort tasks.
    """

    def __init__(self, tok: RouterTokenizer, pool: WorkerPool, attempts: Attempts, background: set) -> None:
        self.tok = tok
        self.pool = pool
        self.attempts = attempts
        self._background = background

    async def stream(self, state: StreamState, legs: Legs | LocalLeg, first: decode_pb2.DecodeChunk,
                     abort_wait: asyncio.Future, handle: Inflight, deadline: float,
                     start: float) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Yield the client's responses from D's first chunk ``first`` to the finish (or "abort"),
        continuing on a new pair when D's stream breaks; ``start`` is the request's arrival
        (monotonic seconds, for TTFT). Raises RouterError: DEADLINE_EXCEEDED, or UNAVAILABLE when
        the stream could not migrate (see :meth:`Dispatcher.generate`)."""
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
            token_ids, logprobs, text = detokenize_chunk(detok, chunk)
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
                       abort_wait: asyncio.Future, handle: Inflight,
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
            new, first, _ = await self.attempts.open(state.continuation(), handle, abort_wait, deadline,
                                                  {failed.worker_id})
        except RouterError as e:
            raise RouterError(e.code, f"{what}; migration failed: {e.message}", e.param, e.err_code) from None
        return new, first



def detokenize_chunk(detok: IncrementalDetokenizer, chunk: decode_pb2.DecodeChunk) -> tuple[Sequence, Sequence, str]:
    """(token ids, logprobs, text) of a D chunk, cut after the token that completes a stop string:
    D sends several tokens in one chunk when its stream lagged, and tokens past a stop string that
    only the router matched are not the client's."""
    ids, parts = chunk.token_ids, []
    for k, t in enumerate(ids):
        parts.append(detok.add(t))
        if detok.stopped:
            return list(ids[:k + 1]), list(chunk.logprobs[:k + 1]), "".join(parts)
    return ids, chunk.logprobs, "".join(parts)
