"""n samples of one prompt (OpenAI ``n`` / ``best_of``, gRPC ``GenerateRequest.n`` / ``best_of``;
docs/architecture.md, Router, n samples).

Each sample is one PD request of the dispatcher (its own room, P and D legs, retries), with the
worker request id ``<id>#<i>`` and, when the request has a ``seed``, the seed ``(seed + i) mod 2**64``:
sample i of a seeded request equals an ``n=1`` request with seed ``seed + i``. Greedy samples are
identical. Sample 0 runs first; the others start once its first token arrived and its Prefill call
returned: by then D (at commit) and P (when it released the job) hold the prompt's full pages in
their radix caches, so every later sample on the same workers matches them: P computes only the last partial page,
no full page crosses the wire again, and D's samples share those pages under lock counts (each
sample owns only its tail and decode pages). An abort or retraction of one sample unlocks only its
own reference. The policies usually pick the same pair for the same prompt (``cache_aware``
remembers its picks, ``kv_events`` sees the cached pages); a sample placed elsewhere just
prefills there.

The client's id is held for the whole fan-out: ``Router.Abort`` of it, a client cancel or a
disconnect ends every sample (each answers ``finish_reason`` abort), and a sample that fails fails
the request (the others are cancelled and aborted on their workers).

``best_of > n``: best_of samples run with logprobs on, and once all have finished the n with the
highest cumulative logprob (sum over the sample's tokens; ties: lower index) are yielded, re-indexed
``0..n-1``; logprobs the client did not ask for are dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator

from protos import common_pb2, router_pb2
from router_svc.admission import Ticket
from router_svc.dispatch import Dispatcher
from router_svc.validation import PreparedRequest

SEED_MOD = 2**64


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed``: ``(seed + index) mod 2**64``."""
    return (seed + index) % SEED_MOD


def sample_request(prep: PreparedRequest, index: int, logprobs: bool = False) -> PreparedRequest:
    """Sample ``index`` of ``prep`` as a request of its own (id ``<id>#<index>``, derived seed,
    ``logprobs`` forced on when asked)."""
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(prep.sampling)
    if sampling.HasField("seed"):
        sampling.seed = sample_seed(sampling.seed, index)
    if logprobs:
        sampling.logprobs = True
    return dataclasses.replace(prep, request_id=f"{prep.request_id}#{index}", sampling=sampling, n=1, best_of=1)


@dataclasses.dataclass
class _End:
    """A sample's stream ended (``exc``: the error it ended with)."""
    index: int
    exc: BaseException | None = None


async def _pump(index: int, stream: AsyncIterator[router_pb2.GenerateResponse], queue: asyncio.Queue) -> None:
    try:
        async for resp in stream:
            await queue.put((index, resp))
        await queue.put(_End(index))
    except Exception as exc:  # RouterError and the like: the fan-out re-raises it
        await queue.put(_End(index, exc))
    finally:
        await stream.aclose()


async def samples(dispatcher: Dispatcher, prep: PreparedRequest, timeout: float | None = None,
                  arrival: float | None = None, ticket: Ticket | None = None,
                  logprobs: bool = False) -> AsyncIterator[tuple[int, router_pb2.GenerateResponse]]:
    """Run ``prep.best_of`` samples; yield ``(index, response)`` in arrival order, interleaved.

    Each sample's last response has its finish_reason and usage (the prompt counted in each).
    ``ticket`` goes with sample 0 (it leaves the admission queue at the first token).

    Raises:
        RouterError: ALREADY_EXISTS for a running request id, or the first error of any sample
            (the others are then ended).
    """
    rid, tenant, count = prep.request_id, prep.tenant, prep.best_of
    try:
        handle = dispatcher.reserve(tenant, rid)
    except Exception:
        if ticket is not None:
            ticket.close()
        raise
    children = [sample_request(prep, i, logprobs) for i in range(count)]
    queue: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Task] = []

    prefilled = asyncio.Event()   # sample 0's Prefill returned: P holds the prompt's pages

    def start(i: int) -> None:
        stream = dispatcher.generate(children[i], timeout=timeout, arrival=arrival, ticket=ticket if i == 0 else None,
                                     prefilled=prefilled if i == 0 else None)
        tasks.append(asyncio.ensure_future(_pump(i, stream, queue)))

    def abort_started() -> None:
        for child in children[:len(tasks)]:
            dispatcher.abort(child.request_id, handle.reason, tenant)

    abort_wait = asyncio.ensure_future(handle.aborted.wait())
    prefilled_wait = asyncio.ensure_future(prefilled.wait())
    get: asyncio.Task | None = None
    first_seen = ended0 = False
    try:
        start(0)
        live = 1
        while live:
            get = asyncio.ensure_future(queue.get())
            waits = {get, abort_wait} | ({prefilled_wait} if len(tasks) == 1 and not prefilled_wait.done() else set())
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if abort_wait.done() and not get.done():
                abort_started()   # each started sample answers its own finish "abort"
                await asyncio.wait({get})
            if get.done():
                item = get.result()
                if isinstance(item, _End):
                    if item.exc is not None:
                        raise item.exc
                    live -= 1
                    ended0 = ended0 or item.index == 0
                else:
                    index, resp = item
                    first_seen = first_seen or index == 0
                    resp.request_id = rid   # the client's id, not the sample's
                    if handle.aborted.is_set() and not resp.finish_reason:
                        abort_started()   # a sample that registered after the abort
                    yield index, resp
            else:   # only sample 0's prefill returned
                get.cancel()
            get = None
            # the others start once sample 0's prompt pages are in D's radix cache (its first token:
            # D committed them) and in P's (its Prefill returned), or once it ended
            ready = (first_seen and prefilled.is_set()) or ended0 or handle.aborted.is_set()
            if len(tasks) == 1 and count > 1 and ready:
                if handle.aborted.is_set():
                    for i in range(1, count):
                        yield i, router_pb2.GenerateResponse(request_id=rid, finish_reason="abort",
                                                             usage=router_pb2.Usage(prompt_tokens=len(prep.input_ids)))
                    count = 1
                else:
                    for i in range(1, count):
                        start(i)
                    live += count - 1
    finally:
        abort_wait.cancel()
        prefilled_wait.cancel()
        if get is not None:
            get.cancel()
        for t in tasks:
            t.cancel()   # a running sample's generator closes its legs and aborts them on the workers
        await asyncio.gather(*tasks, return_exceptions=True)
        dispatcher.release(tenant, rid)


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


__all__ = ["generate_n", "samples", "sample_request", "sample_seed", "cumulative_logprob"]
