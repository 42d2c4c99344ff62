"""n samples of one prompt (OpenAI ``n`` / ``best_of``, gRPC ``GenerateRequest.n`` / ``best_of``;
docs/architecture.md, Router, n samples).

**One PD request** with ``n = best_of`` (``PrefillRequest.n``, ``DecodeRequest.n``): P prefills the
prompt once and samples best_of first tokens from its last logits row (sample i with the seed
``(seed + i) mod 2**64``, so seeded sample i equals an ``n=1`` request with seed ``seed + i``;
greedy samples are identical), the prompt's pages move to D once, and D forks the request into its
samples, which share the prompt's pages (decode_svc/fork.py). D's one stream carries every
sample's chunks, each naming its sample (``DecodeChunk.index``); this module demultiplexes them
into choices: each has its own detokenizer (stop strings), finish reason, logprobs and usage
(the prompt's pages are counted in sample 0's ``kv_pages_transferred`` only).

The client's id is held for the whole request, and so is ``<id>#<i>`` for each sample:
``Router.Abort`` of the id, a client cancel or a disconnect ends every sample (each answers
``finish_reason`` abort); ``Router.Abort`` of ``<id>#<i>`` ends sample i alone on D
(``AbortRequest.sample``), the others run on. A stop string the router matches first ends that
sample the same way. Failures before the first token are retried as for any request
(``Dispatcher.open_pair``); D failing after tokens were sent fails the request with UNAVAILABLE:
an ``n > 1`` stream is not migrated (its samples' generator states and shared pages live on that
D). Never sent to D alone (conditional disaggregation): D would sample one first token.

``best_of > n``: best_of samples run with logprobs on, and once all have finished the n with the
highest cumulative logprob (sum over the sample's tokens; ties: lower index) are yielded, re-indexed
``0..n-1``; logprobs the client did not ask for are dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import AsyncIterator

import grpc

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import sample_seed
from protos import common_pb2, router_pb2
from router_svc.admission import Ticket
from router_svc.dispatch import Dispatcher
from router_svc.relay import detokenize_chunk
from router_svc.errors import RouterError
from router_svc.legs import Legs, code_of, discard, send_aborts
from router_svc.migration import StreamState
from router_svc.request_scope import RequestScope
from router_svc.validation import PreparedRequest
from telemetry import metrics as M


def pd_request(prep: PreparedRequest, logprobs: bool = False) -> PreparedRequest:
    """The one PD request of ``prep``'s best_of samples (``logprobs`` forced on when asked)."""
    if not logprobs:
        return prep
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(prep.sampling)
    sampling.logprobs = True
    return dataclasses.replace(prep, sampling=sampling)


@dataclasses.dataclass(eq=False)
class _Sample:
    """One sample's side of the relay."""
    index: int
    detok: IncrementalDetokenizer
    state: StreamState
    handle: object            # the dispatcher's handle of "<id>#<index>" (its Router.Abort)
    aborted: asyncio.Future   # ... set
    finish: str = ""
    abort_sent: bool = False  # its Router.Abort went on to D


async def samples(dispatcher: Dispatcher, prep: PreparedRequest, timeout: float | None = None,
                  arrival: float | None = None, ticket: Ticket | None = None,
                  logprobs: bool = False) -> AsyncIterator[tuple[int, router_pb2.GenerateResponse]]:
    """Run ``prep.best_of`` samples as one PD request; yield ``(index, response)`` as they stream.

    Each sample's last response has its finish_reason and its usage (the prompt in each; the KV
    pages moved in sample 0's). ``ticket`` leaves the admission queue at the first token.

    Raises:
        RouterError: ALREADY_EXISTS for a running request id (or sample id), UNAVAILABLE (no pair,
            or D failed after tokens were sent: not migrated), DEADLINE_EXCEEDED, and the workers'
            client errors, as ``Dispatcher.generate``.
    """
    start = arrival or time.monotonic()
    deadline = start + (timeout if timeout is not None else dispatcher.request_timeout)
    rid, count = prep.request_id, prep.best_of
    pd = pd_request(prep, logprobs)
    with RequestScope(dispatcher, prep, start, ticket, [f"{rid}#{i}" for i in range(count)]) as scope:
        handle, abort_wait, waits = scope.handle, scope.abort_wait, scope.waits[1:]
        legs, first, attempt = await dispatcher.open_pair(pd, handle, abort_wait, deadline)
        if first is None:   # aborted before the first token
            for i in range(count):
                yield i, scope.aborted_early()
            return
        if ticket is not None:
            ticket.started()
        ss = [_Sample(i, IncrementalDetokenizer(dispatcher.tok.backend, pd.input_ids, pd.stop),
                      StreamState(pd, 0, retries=attempt), scope.handles[i + 1], waits[i]) for i in range(count)]
        async for item in _relay(dispatcher, legs, first, ss, handle, abort_wait, deadline, start):
            yield item


async def _relay(dispatcher: Dispatcher, legs: Legs, first, ss: list[_Sample], handle, abort_wait: asyncio.Future,
                 deadline: float, start: float) -> AsyncIterator[tuple[int, router_pb2.GenerateResponse]]:
    """D's chunks of every sample, demultiplexed by ``DecodeChunk.index``, until all finished."""
    prep = ss[0].state.prep
    meta = dict(request_id=prep.request_id, prefill_worker=legs.p.worker_id, decode_worker=legs.d.worker_id)

    def end_on_d(s: _Sample, reason: str) -> None:
        send_aborts(prep, legs.room, reason, (legs.d,), dispatcher.background, sample=s.index)

    def usage(s: _Sample) -> router_pb2.Usage:
        return s.state.finish(legs.p_done() if s.index == 0 else None)   # P's pages: once

    chunk, read, ttft = first, None, True
    try:
        while True:
            if chunk is None:
                read = read or legs.read()
                for s in ss:   # D answers each with the sample's finish "abort"
                    if s.aborted.done() and not s.abort_sent and not s.finish:
                        s.abort_sent = True
                        end_on_d(s, s.handle.reason or "aborted by client")
                pending = {read, abort_wait} | {s.aborted for s in ss if not s.abort_sent and not s.finish}
                done, _ = await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"deadline passed after {sum(s.state.n_tokens for s in ss)} tokens")
                if abort_wait in done:
                    legs.close(abort=True, reason=handle.reason, background=dispatcher.background)
                    handle.status = "cancelled"
                    for s in ss:
                        if not s.finish:
                            yield s.index, router_pb2.GenerateResponse(
                                text=s.detok.flush(), finish_reason="abort", usage=usage(s), **meta)
                    return
                if read not in done:
                    continue
                exc = read.exception() if not read.cancelled() else asyncio.CancelledError()
                chunk, read = (read.result() if exc is None else None), None
                if exc is not None or chunk is grpc.aio.EOF:
                    code, detail = code_of(exc) if exc is not None else (grpc.StatusCode.UNAVAILABLE,
                                                                          "stream ended before every sample finished")
                    raise RouterError(grpc.StatusCode.UNAVAILABLE,
                                      f"decode worker {legs.d.worker_id} ({legs.d.address}) failed after tokens were "
                                      f"sent: {code.name}: {detail}; not migrated: the {len(ss)} samples of an "
                                      "n > 1 request share one decode stream")
                if not chunk.token_ids and not chunk.finish_reason:
                    chunk = None   # a keepalive: D sends them only before the first token
                    continue
            if chunk.index >= len(ss):
                raise RouterError(grpc.StatusCode.UNAVAILABLE, f"decode worker {legs.d.worker_id} sent sample "
                                  f"{chunk.index} of a request with {len(ss)}")
            s = ss[chunk.index]
            if s.finish:   # the router ended it at a stop string first: D's rest is not the client's
                chunk = None
                continue
            token_ids, logprobs, text = detokenize_chunk(s.detok, chunk)
            s.state.add(chunk, token_ids)
            finish, matched = chunk.finish_reason, chunk.matched_stop
            if s.detok.stopped:
                finish, matched = "stop", s.detok.stop_reason
            resp = router_pb2.GenerateResponse(token_ids=token_ids, logprobs=logprobs, **meta)
            if finish:
                text += s.detok.flush(matched or None)
                matched = s.detok.stop_reason or matched
                if not chunk.finish_reason:
                    end_on_d(s, "stop string matched")
                s.finish = finish
                resp.finish_reason, resp.matched_stop = finish, matched or ""
                resp.usage.CopyFrom(usage(s))
            resp.text = text
            if token_ids:
                if ttft:
                    M.ROUTER_TTFT.labels(tenant=prep.tenant).observe(time.monotonic() - start)
                    ttft = False
                M.ROUTER_COMPLETION_TOKENS.labels(tenant=prep.tenant).inc(len(token_ids))
            yield s.index, resp
            if all(x.finish for x in ss):
                legs.close(abort=False, reason="", background=dispatcher.background)
                handle.status = "cancelled" if all(x.finish == "abort" for x in ss) else "ok"
                return
            chunk = None
    finally:
        if read is not None:
            discard(read)


def cumulative_logprob(responses: list[router_pb2.GenerateResponse]) -> float:
    """Sum of the sampled tokens' logprobs over one sample's responses (nats)."""
    return sum(lp.logprob for r in responses for lp in r.logprobs)


async def generate_n(dispatcher: Dispatcher, prep: PreparedRequest, timeout: float | None = None,
                     arrival: float | None = None,
                     ticket: Ticket | None = None) -> AsyncIterator[tuple[int, router_pb2.GenerateResponse]]:
    """``(index, response)`` of ``prep.n`` choices: the samples as they stream when
    ``best_of == n``, else the n best of ``best_of`` once all finished (module docstring)."""
    stream = samples(dispatcher, prep, timeout, arrival, ticket, logprobs=prep.best_of > prep.n)
    try:
        if prep.best_of == prep.n:
            async for item in stream:
                yield item
            return
        per: dict[int, list[router_pb2.GenerateResponse]] = {i: [] for i in range(prep.best_of)}
        async for index, resp in stream:
            per[index].append(resp)
    finally:
        await stream.aclose()
    wanted = prep.sampling.logprobs
    ranked = sorted(per, key=lambda i: (-cumulative_logprob(per[i]), i))[:prep.n]
    for new, old in enumerate(ranked):
        for resp in per[old]:
            if not wanted:
                del resp.logprobs[:]
            yield new, resp


__all__ = ["generate_n", "samples", "pd_request", "sample_seed", "cumulative_logprob"]
