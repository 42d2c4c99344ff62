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

Steps 1-3 are :class:`router_svc.attempts.Attempts`, step 4 :class:`router_svc.relay.Relay`; this
module keeps the request's lifecycle around them.

Client cancel, disconnect, deadline, ``Router.Abort`` and a stop string seen by the router all
cancel the calls and send ``Abort`` to both legs. Every exit path goes through one
``RequestScope`` (router_svc/request_scope.py).

Request ids are scoped per tenant: running requests are keyed by ``(tenant, request_id)``, so
``Router.Abort`` and the ALREADY_EXISTS check reach only the caller's own requests, and workers get
``PreparedRequest.worker_request_id`` (``<tenant>/<id>``), unique across tenants.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

import grpc

from telemetry import metrics as M
from protos import router_pb2
from router_svc.admission import Admission, Ticket
from router_svc.api_keys import ANONYMOUS
from router_svc.attempts import Attempts, Inflight
from router_svc.errors import RouterError
from router_svc.local_prefill import LocalPrefillPolicy
from router_svc.migration import StreamState
from router_svc.pair_policy import KVPairPolicy
from router_svc.policies import Policy
from router_svc.pool import WorkerPool
from router_svc.relay import Relay
from router_svc.request_scope import RequestScope
from router_svc.tokenizer import RouterTokenizer
from router_svc.validation import PreparedRequest

# final statuses of a client request (label `status` of halfmoon_router_requests_total)
REQUEST_STATUSES = M.REQUEST_STATUSES


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
        self._inflight: dict[tuple[str, str], Inflight] = {}
        self._background: set = set()
        self.attempts = Attempts(pool, prefill_policy, decode_policy, max_attempts, first_token_timeout,
                                 pair_policy, local_prefill, self._background)
        self.relay = Relay(tok, pool, self.attempts, self._background)

    def abort(self, request_id: str, reason: str = "aborted by client", tenant: str = ANONYMOUS) -> bool:
        """Abort ``tenant``'s running request ``request_id`` (``Router.Abort``); False when that tenant
        runs none with that id (another tenant's request of the same id is not touched)."""
        h = self._inflight.get((tenant, request_id))
        if h is None:
            return False
        h.reason = reason
        h.aborted.set()
        return True

    def reserve(self, tenant: str, request_id: str) -> Inflight:
        """Mark ``tenant``'s ``request_id`` running (its :meth:`abort` sets the handle's event); also
        used by the fan-out of n samples (router_svc/fanout.py) for the client's id.

        Raises:
            RouterError: ALREADY_EXISTS naming ``request_id`` when that tenant already runs it.
        """
        key = (tenant, request_id)
        if key in self._inflight:
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request_id!r} is already running",
                              "request_id")
        handle = self._inflight[key] = Inflight()
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

    @property
    def background(self) -> set:
        """The dispatcher's background tasks (Abort calls of closed legs): a caller that closes legs
        itself (router_svc/fanout.py) adds its tasks here, so they are awaited at shutdown."""
        return self._background

    async def open_pair(self, prep: PreparedRequest, handle: Inflight, abort_wait: asyncio.Future,
                        deadline: float):
        """One request's pair and D's first chunk, retried as :meth:`generate` does, for the fan-out
        of n samples (router_svc/fanout.py), which relays the chunks itself: (legs, first chunk or
        None when aborted, attempts - 1). Raises RouterError."""
        return await self.attempts.open(prep, handle, abort_wait, deadline, set())

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
        with RequestScope(self, prep, start, ticket) as scope:
            handle = scope.handle
            legs, first, attempt = await self.attempts.open(prep, handle, scope.abort_wait, deadline, set())
            if first is None:  # aborted before the first token
                yield scope.aborted_early()
                return
            if ticket is not None:
                ticket.started()
            state = StreamState(prep, self.migration_limit, retries=attempt)
            async for resp in self.relay.stream(state, legs, first, scope.abort_wait, handle, deadline, start):
                if resp.finish_reason:
                    handle.status = "cancelled" if resp.finish_reason == "abort" else "ok"
                yield resp
