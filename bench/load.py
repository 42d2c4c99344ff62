"""The load generator: fixed concurrency or Poisson arrivals, bounded by request count and/or time.

- Fixed concurrency ``C`` (closed loop): ``C`` workers each take the next session and send its turns
  back to back.
- Request rate ``R`` (open loop): sessions arrive as a Poisson process of rate ``R`` per second
  (exponential gaps from a seeded ``random.Random``, as vLLM's ``--request-rate``); ``C``, when given,
  caps the sessions in flight (vLLM ``--max-concurrency``).
- Multi-turn (``Session.chat``) sessions send turn ``k+1`` after turn ``k`` returns, with the actual
  reply appended to the history; a failed turn ends its conversation.
- Bounds: no new request is sent once ``max_requests`` were sent or ``duration_s`` has passed since
  the start; requests in flight complete and are measured.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Sequence
from typing import Protocol

from bench.request import BenchRequest, RequestRecord
from bench.workloads import Session


class Target(Protocol):
    """What the load generator needs from a target (router gRPC or OpenAI HTTP)."""

    name: str

    async def generate(self, req: BenchRequest) -> RequestRecord: ...


@dataclasses.dataclass
class LoadResult:
    """Records in completion order; ``t0`` first send and ``t1`` last stream end (perf_counter s)."""

    records: list[RequestRecord]
    t0: float
    t1: float

    @property
    def duration_s(self) -> float:
        return max(0.0, self.t1 - self.t0)


def arrival_gaps(rate: float, n: int, seed: int) -> list[float]:
    """``n`` Poisson inter-arrival gaps (seconds): exponential with mean ``1 / rate``, seeded."""
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(n)]


class _Run:
    def __init__(self, target: Target, max_requests: int | None, duration_s: float | None, progress):
        self.target = target
        self.max_requests = max_requests
        self.duration_s = duration_s
        self.progress = progress
        self.sent = 0
        self.records: list[RequestRecord] = []
        self.t0 = time.perf_counter()

    def exhausted(self) -> bool:
        if self.max_requests is not None and self.sent >= self.max_requests:
            return True
        return self.duration_s is not None and time.perf_counter() - self.t0 >= self.duration_s

    async def session(self, s: Session) -> None:
        history: list[dict[str, str]] = []
        for req in s.requests:
            if self.exhausted():
                return
            user = None
            if s.chat:
                if not req.messages:
                    raise ValueError(f"session {s.session_id}: chat turn {req.turn} has no user message")
                user = req.messages[-1]
                req = dataclasses.replace(req, messages=history + [user])
            self.sent += 1
            rec = await self.target.generate(req)
            self.records.append(rec)
            if self.progress is not None:
                self.progress.update(1)
            if s.chat:
                if not rec.ok:
                    return
                history += [user, {"role": "assistant", "content": rec.text}]


async def run_load(target: Target, sessions: Sequence[Session], *, concurrency: int | None = None,
                   request_rate: float | None = None, max_requests: int | None = None,
                   duration_s: float | None = None, seed: int = 0, progress=None) -> LoadResult:
    """Drive ``sessions`` through ``target``.

    Args:
        target: where to send.
        sessions: what to send, in order.
        concurrency: closed-loop workers (rate None), or the in-flight cap (rate given; None = no cap).
        request_rate: Poisson session arrivals per second; None or inf = closed loop.
        max_requests: stop sending after this many requests (turns count one each).
        duration_s: stop sending after this many seconds.
        seed: seeds the arrival process.
        progress: a ``tqdm`` bar (or anything with ``update(n)``), or None.

    Raises:
        ValueError: neither ``concurrency`` nor a finite ``request_rate`` given, or a value <= 0.
    """
    open_loop = request_rate is not None and request_rate != float("inf")
    if open_loop and request_rate <= 0:
        raise ValueError(f"request_rate: expected > 0, got {request_rate}")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency: expected >= 1, got {concurrency}")
    if not open_loop and concurrency is None:
        raise ValueError("give a concurrency (closed loop) or a finite request_rate (Poisson arrivals)")
    run = _Run(target, max_requests, duration_s, progress)
    if not open_loop:
        it = iter(sessions)

        async def worker() -> None:
            for s in it:  # shared iterator: each session goes to exactly one worker
                if run.exhausted():
                    return
                await run.session(s)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    else:
        gaps = arrival_gaps(request_rate, len(sessions), seed)
        sem = asyncio.Semaphore(concurrency) if concurrency else None

        async def limited(s: Session) -> None:
            if sem is None:
                await run.session(s)
                return
            async with sem:
                await run.session(s)

        tasks = []
        for s, gap in zip(sessions, gaps):
            if run.exhausted():
                break
            tasks.append(asyncio.create_task(limited(s)))
            await asyncio.sleep(gap)
        await asyncio.gather(*tasks)
    t1 = max((r.end for r in run.records), default=run.t0)
    t0 = min((r.start for r in run.records), default=run.t0)
    return LoadResult(run.records, t0, t1)
