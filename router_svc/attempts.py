"""One request's attempts before its first token: pick a pair (or D alone), mint the room, start the
legs, wait for D's first chunk, and retry on a new pair (docs/architecture.md, A request's path).

:class:`Inflight` is the running request's handle the attempts fill in (its legs, how it ended).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field

import grpc

from telemetry import metrics as M
from protos import decode_pb2
from router_svc.errors import RouterError
from router_svc.legs import LegFailure, Legs, LocalLeg, code_of, discard
from router_svc.local_prefill import LocalPrefillPolicy
from router_svc.pair_policy import KVPairPolicy
from router_svc.policies import NoWorkerError, Policy
from router_svc.pool import WorkerPool
from router_svc.validation import PreparedRequest
from router_svc.worker import DECODE, PREFILL

log = logging.getLogger("halfmoon.router.dispatch")

# Worker errors that are the client's fault: returned as they are, never retried.
_CLIENT_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)


@dataclass
class Inflight:
    """A running client request: ``Router.Abort``'s handle, its current pair and how it ended."""
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""
    legs: "Legs | LocalLeg | None" = None
    status: str = "error"  # label of halfmoon_router_requests_total once it ends



class Attempts:
    """Opens a request's pair, retrying before the first token.

    Args:
        pool, prefill_policy, decode_policy, pair_policy, local_prefill, max_attempts,
        first_token_timeout: as :class:`router_svc.dispatch.Dispatcher`.
        background: the dispatcher's set of background Abort tasks (kept referenced until done).
    """

    def __init__(self, pool: WorkerPool, prefill_policy: Policy, decode_policy: Policy, max_attempts: int,
                 first_token_timeout: float, pair_policy: KVPairPolicy | None,
                 local_prefill: LocalPrefillPolicy | None, background: set) -> None:
        self.pool = pool
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.max_attempts = max_attempts
        self.first_token_timeout = first_token_timeout
        self.pair_policy = pair_policy
        self.local_prefill = local_prefill
        self._background = background

    async def open(self, prep: PreparedRequest, handle: Inflight, abort_wait: asyncio.Future,
                   deadline: float, tried: set[str]) -> tuple[Legs | LocalLeg, decode_pb2.DecodeChunk | None, int]:
        """Pick a pair (avoiding ``tried`` when others are available), start both legs and wait for
        D's first token, retrying on a new pair up to ``max_attempts`` times. Returns (legs, first
        chunk or None when aborted meanwhile (the legs are closed then), attempts - 1); the legs
        are also ``handle.legs``, so that every exit closes them.

        Raises:
            RouterError: as :meth:`Dispatcher.generate` (``handle.status`` says how to count it).
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
                first = await self.first_chunk(legs, abort_wait, deadline)
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


    async def first_chunk(self, legs: Legs | LocalLeg, abort_wait: asyncio.Future, deadline: float):
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

