"""Metrics the router owns (router_svc): requests, latencies and tokens as the client sees them.

The catalog (names, labels, meaning) is the docstring of :mod:`telemetry.metrics`.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

from telemetry.label_values import RETRY_LEGS, MIGRATION_REASONS, LOCAL_PREFILL_REASONS
from telemetry.buckets import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS

# Created unregistered (registry=None): telemetry.exposition.build_registry attaches them per
# process, so a process exports only the groups its role owns.
_R = None

# `tenant` is a tenant of the router's API key file, "default" (--api-key / $HALFMOON_API_KEY) or
# "anonymous" (no key configured): never a client-chosen string, so the label stays bounded.
ROUTER_REQUESTS = Counter(
    "halfmoon_router_requests_total", "Finished client requests by final status, routing policy and tenant.",
    ["status", "policy", "tenant"], registry=_R)
ROUTER_TTFT = Histogram(
    "halfmoon_router_time_to_first_token_seconds",
    "Seconds from request arrival at the router to the first token sent to the client.",
    ["tenant"], buckets=TTFT_BUCKETS, registry=_R)
ROUTER_ITL = Histogram(
    "halfmoon_router_inter_token_latency_seconds",
    "Seconds between consecutive tokens streamed to the client (one observation per token after the first).",
    ["tenant"], buckets=ITL_BUCKETS, registry=_R)
ROUTER_E2E = Histogram(
    "halfmoon_router_e2e_request_latency_seconds",
    "Seconds from request arrival to the last token or the error.",
    ["tenant"], buckets=E2E_BUCKETS, registry=_R)
ROUTER_RETRIES = Counter(
    "halfmoon_router_retries_total",
    "Prefill/decode pair re-picks after a leg failed before the first token, by failed leg.",
    ["leg"], registry=_R)
ROUTER_LOCAL_PREFILLS = Counter(
    "halfmoon_router_local_prefills_total",
    "Attempts sent to a decode worker alone, which prefills the prompt's uncached tail itself, by reason.",
    ["reason"], registry=_R)
ROUTER_MIGRATIONS = Counter(
    "halfmoon_router_migrations_total",
    "Streams re-dispatched to another pair after their decode worker failed or drained mid-stream "
    "(prompt + the tokens already sent; the client's stream goes on), by reason.",
    ["reason"], registry=_R)
ROUTER_IN_FLIGHT = Gauge(
    "halfmoon_router_requests_in_flight", "Client requests accepted and not yet finished.",
    registry=_R)
ROUTER_QUEUED = Gauge(
    "halfmoon_router_queued_requests",
    "Client requests admitted whose first token has not been sent yet (bounded by --max-queued-requests).",
    registry=_R)
ROUTER_PROMPT_TOKENS = Counter(
    "halfmoon_router_prompt_tokens_total",
    "Prompt tokens of client requests (after the chat template), once per request, by tenant.",
    ["tenant"], registry=_R)
ROUTER_COMPLETION_TOKENS = Counter(
    "halfmoon_router_completion_tokens_total", "Completion tokens streamed to clients, by tenant.",
    ["tenant"], registry=_R)
ROUTER_AUTH_FAILURES = Counter(
    "halfmoon_router_auth_failures_total",
    "Calls refused for a missing or unknown API key (HTTP 401 / UNAUTHENTICATED), by API and reason.",
    ["api", "reason"], registry=_R)
AUTH_APIS = ("http", "grpc")
AUTH_FAILURE_REASONS = ("missing", "invalid")

# this group's metrics, in exposition order (telemetry.exposition.METRICS_BY_GROUP['router'])
METRICS = (
    ROUTER_REQUESTS, ROUTER_TTFT, ROUTER_ITL, ROUTER_E2E, ROUTER_RETRIES, ROUTER_MIGRATIONS,
    ROUTER_IN_FLIGHT, ROUTER_QUEUED, ROUTER_PROMPT_TOKENS, ROUTER_COMPLETION_TOKENS,
    ROUTER_AUTH_FAILURES, ROUTER_LOCAL_PREFILLS)

# Known label values are created up front, so their series exist (at 0) from the first scrape:
# rate() and alerts then work before the first event.
for _leg in RETRY_LEGS:
    ROUTER_RETRIES.labels(leg=_leg)
for _reason in LOCAL_PREFILL_REASONS:
    ROUTER_LOCAL_PREFILLS.labels(reason=_reason)
for _reason in MIGRATION_REASONS:
    ROUTER_MIGRATIONS.labels(reason=_reason)
for _api in AUTH_APIS:
    for _reason in AUTH_FAILURE_REASONS:
        ROUTER_AUTH_FAILURES.labels(api=_api, reason=_reason)


def init_router_series(policy: str, tenants: Iterable[str], statuses: Iterable[str]) -> None:
    """Create the router's per-tenant series at 0 (requests by status, latencies, tokens), so
    rate() and alerts see a tenant's first requests."""
    statuses = tuple(statuses)
    for tenant in tenants:
        for status in statuses:
            ROUTER_REQUESTS.labels(status=status, policy=policy, tenant=tenant)
        for metric in (ROUTER_TTFT, ROUTER_ITL, ROUTER_E2E, ROUTER_PROMPT_TOKENS, ROUTER_COMPLETION_TOKENS):
            metric.labels(tenant=tenant)
