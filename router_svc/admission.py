"""Admission limits of the router's front door: a per-tenant token bucket and a bounded admission
queue, checked before a request is validated or anything is allocated on any worker
(docs/architecture.md, The router's front door).

- **Rate limit** (``--rate-limit-rps`` R, ``--rate-limit-burst`` B; R = 0 is off): every tenant has
  its own bucket of B tokens refilled at R per second (the ``token-bucket`` library); a generation
  request takes one token. An empty bucket: RESOURCE_EXHAUSTED / HTTP 429, ``Retry-After`` = the
  whole seconds until the next token.
- **Admission queue** (``--max-queued-requests`` Q; 0 is unbounded): requests admitted whose first
  token has not been sent yet (waiting for a worker's queue, prefill, the KV transfer) across all
  tenants. A request that would be the Q+1-th: RESOURCE_EXHAUSTED / HTTP 429, ``Retry-After: 1``.
"""

from __future__ import annotations

import math

import grpc
import token_bucket

from telemetry import metrics as M
from router_svc.errors import RouterError


class Ticket:
    """A request's place in the admission queue: given back once, at its first token or its end."""

    def __init__(self, admission: "Admission | None") -> None:
        self._admission = admission

    def started(self) -> None:
        """The first token went out: the request leaves the queue (idempotent)."""
        if self._admission is not None:
            self._admission.queued -= 1
            M.ROUTER_QUEUED.dec()
            self._admission = None

    close = started  # the request ended without a first token: same release


class Admission:
    """Per-tenant rate limits and the admission queue bound.

    Args:
        rate_rps: tokens per second per tenant (0 = no rate limit).
        burst: bucket capacity (0 = ``max(1, ceil(rate_rps))``).
        max_queued: most requests admitted and not yet at their first token (0 = unbounded).

    Raises:
        ValueError: a negative number.
    """

    def __init__(self, rate_rps: float = 0.0, burst: int = 0, max_queued: int = 0) -> None:
        if rate_rps < 0 or burst < 0 or max_queued < 0:
            raise ValueError("--rate-limit-rps, --rate-limit-burst and --max-queued-requests must be >= 0")
        self.rate_rps = float(rate_rps)
        self.burst = int(burst) or max(1, math.ceil(self.rate_rps))
        self.max_queued = int(max_queued)
        self._storage = token_bucket.MemoryStorage()
        self._limiter = token_bucket.Limiter(self.rate_rps, self.burst, self._storage) if self.rate_rps else None
        self.queued = 0

    def retry_after_s(self, tenant: str) -> int:
        """Whole seconds until ``tenant``'s bucket holds a token again (at least 1)."""
        missing = max(0.0, 1.0 - self._storage.get_token_count(tenant))
        return max(1, math.ceil(missing / self.rate_rps))

    def admit(self, tenant: str) -> Ticket:
        """Take a token of ``tenant``'s bucket and a queue place.

        Raises:
            RouterError: RESOURCE_EXHAUSTED with ``retry_after`` set (HTTP 429), ``err_code``
                ``rate_limit_exceeded`` or ``queue_full``. Nothing is taken then.
        """
        if self.max_queued and self.queued >= self.max_queued:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the router's admission queue is full ({self.max_queued} requests waiting "
                              f"for their first token, --max-queued-requests); retry after 1 s",
                              err_code="queue_full", retry_after=1)
        if self._limiter is not None and not self._limiter.consume(tenant):
            wait = self.retry_after_s(tenant)
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"rate limit reached for tenant {tenant!r}: {self.rate_rps:g} requests/s, "
                              f"burst {self.burst} (--rate-limit-rps, --rate-limit-burst); retry after {wait} s",
                              err_code="rate_limit_exceeded", retry_after=wait)
        self.queued += 1
        M.ROUTER_QUEUED.inc()
        return Ticket(self)


__all__ = ["Admission", "Ticket"]
