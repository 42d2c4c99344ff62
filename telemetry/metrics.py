"""The halfmoon metric catalog: every Prometheus metric of every service, defined once, here.

Services import the objects they own and update them; nothing else defines metrics. Each quantity
is counted by exactly one service (its *owner*), so a PromQL ``sum(...)`` over all scrape targets
never double-counts. Names follow Prometheus conventions: prefix ``halfmoon_<owner>_``, base units
in the name (``_seconds``, ``_bytes``, ``_tokens``, ``_pages``, ``_ratio``), counters end in
``_total``.

Exposition and labels
---------------------
Each process serves ``/metrics`` with :func:`start_metrics_server`, which exposes only the metric
groups its role owns (``router`` → router; ``prefill`` → prefill + transfer; ``decode`` → decode;
``registry`` → registry), plus the Python process collectors and ``halfmoon_worker_info``. A
process therefore never exports all-zero series for quantities another service owns.

Worker identity is **not** a label on every metric: it comes from the scrape target (Prometheus'
``instance`` label, and on Kubernetes the ``pod``/``service`` labels a ServiceMonitor attaches). The
scrape job names the role: ``job="halfmoon-<role>"`` (the Helm chart's ServiceMonitor and
deploy/prometheus/prometheus-local.yml; the alert rules rely on it). The info gauge
``halfmoon_worker_info{role, worker_id, model, version} = 1`` carries the rest; join on
``instance`` when a panel needs the worker id, e.g.
``halfmoon_decode_kv_pool_usage_ratio * on(instance) group_left(worker_id) halfmoon_worker_info``.

Catalog (owner — name — type — labels — meaning)
------------------------------------------------
router (router_svc; tokens and latencies as the client sees them, one count per client request;
``tenant`` is the API key's tenant: a name of the key file, ``default`` or ``anonymous``, never a
client-chosen string)
  - ``halfmoon_router_requests_total`` counter {status, policy, tenant}: finished client requests;
    status ∈ :data:`REQUEST_STATUSES` (ok, error, cancelled, timeout, invalid, rejected,
    rate_limited, queue_full).
  - ``halfmoon_router_time_to_first_token_seconds`` histogram {tenant}: request arrival → first token sent.
  - ``halfmoon_router_inter_token_latency_seconds`` histogram {tenant}: gap between consecutive
    streamed tokens of one request (one observation per token after the first).
  - ``halfmoon_router_e2e_request_latency_seconds`` histogram {tenant}: arrival → last token / error.
  - ``halfmoon_router_retries_total`` counter {leg}: pair re-picks after a failed leg before the first
    token; leg ∈ {prefill, decode}.
  - ``halfmoon_router_local_prefills_total`` counter {reason}: attempts sent to a decode worker
    alone, which prefills the prompt's uncached tail itself (conditional disaggregation, no
    prefill leg); reason ∈ :data:`LOCAL_PREFILL_REASONS` (short_tail: D holds all but at most
    ``--local-prefill-max-tokens``; prefill_queue: every P has ``--local-prefill-queue`` requests).
  - ``halfmoon_router_requests_in_flight`` gauge: requests accepted and not yet finished.
  - ``halfmoon_router_queued_requests`` gauge: requests admitted whose first token is not sent yet
    (the admission queue ``--max-queued-requests`` bounds).
  - ``halfmoon_router_prompt_tokens_total`` counter {tenant}: prompt tokens of client requests (after
    the chat template), counted once per request whatever the retries.
  - ``halfmoon_router_completion_tokens_total`` counter {tenant}: tokens streamed to clients.
  - ``halfmoon_router_auth_failures_total`` counter {api, reason}: calls refused for their API key;
    api ∈ {http, grpc}, reason ∈ {missing, invalid}.
prefill (prefill_svc; work done by prefill workers, retried attempts included)
  - ``halfmoon_prefill_queue_requests`` gauge {queue}: requests per stage; queue ∈
    :data:`PREFILL_QUEUES` (waiting_destination, prefilling, transferring).
  - ``halfmoon_prefill_prompt_tokens_total`` counter: prompt tokens of Prefill RPCs accepted.
  - ``halfmoon_prefill_cached_tokens_total`` counter: of those, tokens served from the prefill radix
    cache (prefix hits; not recomputed). Hit rate = cached / prompt.
  - ``halfmoon_prefill_batch_size_requests`` histogram: requests per prefill forward batch.
  - ``halfmoon_prefill_batch_tokens`` histogram: extend tokens per prefill forward batch.
  - ``halfmoon_prefill_compute_seconds`` histogram: wall seconds of one prefill forward batch
    (``_sum`` is total compute time, so ``rate(_sum)`` is the busy fraction).
transfer (transfer_svc engine, counted on the **sender**, i.e. in the prefill process; label-free)
  - ``halfmoon_transfer_pages_total`` counter: KV pages written to decode peers.
  - ``halfmoon_transfer_bytes_total`` counter: bytes written (GB/s = ``rate(...)/1e9`` in PromQL).
  - ``halfmoon_transfer_batch_seconds`` histogram: one submitted batch, submit → all writes complete.
  - ``halfmoon_transfer_failures_total`` counter {reason}: failed batches; reason ∈
    :data:`TRANSFER_FAILURE_REASONS` (timeout, peer_unreachable, remote_error, checksum_mismatch,
    aborted, other). All reasons are pre-initialised to 0 so rates exist before the first failure.
decode (decode_svc)
  - ``halfmoon_decode_queue_requests`` gauge {queue}: queue ∈ :data:`DECODE_QUEUES`: prealloc
    (waiting for KV pages), transfer (pages allocated, waiting for the prefill's KV + notice),
    waiting (KV committed, waiting to join the running batch), retracted (KV given back when the
    pool ran short, waiting to resume), local_prefill (no prefill leg: D computes the prompt's
    uncached tail itself).
  - ``halfmoon_decode_running_requests`` gauge: requests in the running (continuous) batch.
  - ``halfmoon_decode_kv_pool_usage_ratio`` gauge: 1 − (free + evictable) / total pages of the KV
    pool, in [0, 1]: the share held by requests (locked prefixes + owned pages), as SGLang's
    token usage; evictable radix pages count as available. Alerts and the decode HPA use it.
  - ``halfmoon_decode_kv_pool_pages`` gauge {state}: pages per state ∈ :data:`KV_PAGE_STATES`
    (free, evictable, locked, owned); the states sum to the pool size.
  - ``halfmoon_decode_prompt_tokens_total`` counter: prompt tokens of requests pre-allocated.
  - ``halfmoon_decode_prefix_hit_tokens_total`` counter: of those, tokens matched in the decode radix
    cache (sum of ``pre_len``; not transferred). Hit rate = prefix_hit / prompt.
  - ``halfmoon_decode_generated_tokens_total`` counter: tokens sampled by decode workers (first token
    from the prefill notice excluded).
  - ``halfmoon_decode_evicted_pages_total`` counter: radix-cache pages evicted (LRU) to make room.
  - ``halfmoon_decode_kv_checksum_mismatches_total`` counter: with ``--kv-checksums``, cached pages
    whose crc32 changed since they entered the radix cache, found when a prefix hit reused them
    (each is evicted with what follows it and recomputed, never served; one WARNING each).
  - ``halfmoon_decode_kv_wait_seconds`` histogram: pre-allocation done → KV committed (notice
    verified), per request.
  - ``halfmoon_decode_quarantine_releases_total`` counter {cause}: quarantined destination rooms
    released; cause ∈ :data:`QUARANTINE_RELEASE_CAUSES` (notice, rejected, process_gone,
    new_incarnation, fence_deadline). fence_deadline means P never answered within its write fence.
  - ``halfmoon_decode_retractions_total`` counter {reason}: running requests retracted because a
    decode step could not grow them; reason ∈ :data:`RETRACTION_REASONS` (newest: the newest
    unpinned request; pinned: every candidate was pinned, the newest taken).
  - ``halfmoon_decode_reserve_misses_total`` counter: decode steps at which a request outgrew its
    reserve and the pool (after eviction) could not give the next page.
  - ``halfmoon_decode_resume_recomputed_tokens_total`` counter: tokens D recomputed itself (EXTEND)
    when a retracted request resumed (its prefix the radix cache no longer held).
  - ``halfmoon_decode_local_prefills_total`` counter: requests whose prompt D prefilled itself
    (``DecodeRequest.local_prefill``: conditional disaggregation, no prefill leg).
  - ``halfmoon_decode_local_prefill_tokens_total`` counter: prompt tokens D computed (EXTEND) for
    them (prompt minus D's radix hit).
  - ``halfmoon_decode_kv_projected_pages`` gauge: pages the live requests are projected to still
    take (admission keeps them available); compare with ``kv_pool_pages{state="owned"}``.
  - ``halfmoon_decode_new_token_ratio`` gauge: the projection's ratio of remaining tokens a request
    is expected to still generate, in (0, 1].
  - ``halfmoon_decode_finished_token_share`` histogram: per request that ended by itself, generated
    / min(max_tokens, clip): the actual share that ``new_token_ratio`` projects (the ratio learns
    its moving average); projected vs actual usage is this against the ratio gauge.
  - ``halfmoon_decode_step_seconds_total`` counter {part}: wall seconds of decode steps (a step's
    start to the next one's, while requests run), part ∈ :data:`STEP_PARTS`: device (inside the
    forward and sampling calls, or waiting for their tokens) or host (the rest: bookkeeping,
    streaming, the GIL).
  - ``halfmoon_decode_step_requests_total`` counter: running requests summed over those steps;
    ``rate(step_seconds{part="host"}) / rate(step_requests)`` is the host cost per request-step.
registry (transfer_svc registry service, ``halfmoon serve-transfer``)
  - ``halfmoon_registry_workers`` gauge {role}: live registered workers; role ∈ {prefill, decode}.
  - ``halfmoon_registry_expired_leases_total`` counter: segments dropped because heartbeats stopped.
  - ``halfmoon_registry_lookups_total`` counter {result}: GetSegment calls; result ∈ {found,
    not_found}.
every process
  - ``halfmoon_worker_info`` gauge {role, worker_id, model, version} = 1 (set by
    :func:`start_metrics_server`), and prometheus_client's ``process_*`` / ``python_*`` collectors.

Histogram buckets (seconds) span CPU and GPU: TTFT 5 ms–120 s, ITL 0.5 ms–5 s, forward 0.5 ms–60 s,
transfer batch 10 µs–10 s (one UCX put is ≈1 µs on shared memory, ≈8 µs through cuda_ipc, as
measured with bench/transfer.py and bench/gpu_transfer.py).
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR
from prometheus_client import disable_created_metrics
from prometheus_client.exposition import start_http_server

# The `*_created` timestamp series only double the exposition in the text format; nothing reads them.
disable_created_metrics()

__all__ = [
    "ROLES", "GROUPS_BY_ROLE", "REQUEST_STATUSES", "PREFILL_QUEUES", "DECODE_QUEUES", "LOCAL_PREFILL_REASONS",
    "STEP_PARTS",
    "RETRACTION_REASONS",
    "KV_PAGE_STATES", "TRANSFER_FAILURE_REASONS", "QUARANTINE_RELEASE_CAUSES", "REGISTRY_LOOKUP_RESULTS", "METRICS_BY_GROUP",
    "build_registry", "start_metrics_server", "stop_metrics_servers",
]

# --- label values (documented sets; use these constants rather than string literals) ----------
REQUEST_STATUSES = ("ok", "error", "cancelled", "timeout", "invalid", "rejected", "rate_limited", "queue_full")
RETRY_LEGS = ("prefill", "decode")
# why a stream moved to another pair after tokens were sent: its decode worker failed / was draining
MIGRATION_REASONS = ("failure", "drain")
PREFILL_QUEUES = ("waiting_destination", "prefilling", "transferring")
DECODE_QUEUES = ("prealloc", "transfer", "waiting", "retracted", "local_prefill")
LOCAL_PREFILL_REASONS = ("short_tail", "prefill_queue")
STEP_PARTS = ("device", "host")
RETRACTION_REASONS = ("newest", "pinned")
KV_PAGE_STATES = ("free", "evictable", "locked", "owned")
QUARANTINE_RELEASE_CAUSES = ("notice", "rejected", "process_gone", "new_incarnation", "fence_deadline")
TRANSFER_FAILURE_REASONS = (
    "timeout", "peer_unreachable", "remote_error", "checksum_mismatch", "aborted", "other")
WORKER_ROLES = ("prefill", "decode")
REGISTRY_LOOKUP_RESULTS = ("found", "not_found")

# --- buckets (seconds unless named otherwise) --------------------------------------------------
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
               0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
               300.0, 600.0)
COMPUTE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
TRANSFER_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05,
                    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
KV_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0)
SHARE_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0)
BATCH_REQUEST_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BATCH_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

# Metrics are created unregistered (registry=None) and attached per process by build_registry(),
# so a process exports only the groups its role owns.
_R = None

# --- router -------------------------------------------------------------------------------------
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

# --- prefill ------------------------------------------------------------------------------------
PREFILL_QUEUE = Gauge(
    "halfmoon_prefill_queue_requests",
    "Requests in each prefill stage: waiting_destination, prefilling, transferring.",
    ["queue"], registry=_R)
PREFILL_PROMPT_TOKENS = Counter(
    "halfmoon_prefill_prompt_tokens_total", "Prompt tokens of accepted Prefill RPCs.", registry=_R)
PREFILL_CACHED_TOKENS = Counter(
    "halfmoon_prefill_cached_tokens_total",
    "Prompt tokens served from the prefill radix cache (prefix hits, not recomputed).", registry=_R)
PREFILL_BATCH_SIZE = Histogram(
    "halfmoon_prefill_batch_size_requests", "Requests per prefill forward batch.",
    buckets=BATCH_REQUEST_BUCKETS, registry=_R)
PREFILL_BATCH_TOKENS = Histogram(
    "halfmoon_prefill_batch_tokens", "Extend (computed) tokens per prefill forward batch.",
    buckets=BATCH_TOKEN_BUCKETS, registry=_R)
PREFILL_COMPUTE_SECONDS = Histogram(
    "halfmoon_prefill_compute_seconds", "Wall seconds of one prefill forward batch.",
    buckets=COMPUTE_BUCKETS, registry=_R)

# --- transfer (sender side: the prefill process) -----------------------------------------------
TRANSFER_PAGES = Counter(
    "halfmoon_transfer_pages_total", "KV pages written to decode peers (sender side).", registry=_R)
TRANSFER_RANK_PAGES = Counter(
    "halfmoon_transfer_rank_pages_total",
    "KV pages submitted per (prefill rank, decode rank) pair under tensor parallelism (each moves "
    "its kv-head slice of the page).", ["src_rank", "dst_rank"], registry=_R)
TRANSFER_BYTES = Counter(
    "halfmoon_transfer_bytes_total", "KV bytes written to decode peers (sender side).", registry=_R)
TRANSFER_BATCH_SECONDS = Histogram(
    "halfmoon_transfer_batch_seconds",
    "Seconds from submitting one transfer batch to completion of all its writes.",
    buckets=TRANSFER_BUCKETS, registry=_R)
TRANSFER_FAILURES = Counter(
    "halfmoon_transfer_failures_total", "Failed transfer batches by reason (sender side).",
    ["reason"], registry=_R)

# --- decode -------------------------------------------------------------------------------------
DECODE_QUEUE = Gauge(
    "halfmoon_decode_queue_requests",
    "Requests in each decode queue: prealloc, transfer, waiting (KV committed, not yet running).",
    ["queue"], registry=_R)
DECODE_RUNNING = Gauge(
    "halfmoon_decode_running_requests", "Requests in the running decode batch.", registry=_R)
DECODE_KV_USAGE = Gauge(
    "halfmoon_decode_kv_pool_usage_ratio",
    "Share of the decode KV pool held by requests: 1 - (free + evictable) / total pages.",
    registry=_R)
DECODE_KV_PAGES = Gauge(
    "halfmoon_decode_kv_pool_pages", "Decode KV pool pages by state (free, evictable, locked, owned).",
    ["state"], registry=_R)
DECODE_PROMPT_TOKENS = Counter(
    "halfmoon_decode_prompt_tokens_total", "Prompt tokens of requests pre-allocated on decode.",
    registry=_R)
DECODE_PREFIX_HIT_TOKENS = Counter(
    "halfmoon_decode_prefix_hit_tokens_total",
    "Prompt tokens matched in the decode radix cache (sum of pre_len; not transferred).", registry=_R)
DECODE_GENERATED_TOKENS = Counter(
    "halfmoon_decode_generated_tokens_total", "Tokens sampled by decode workers.", registry=_R)
DECODE_EVICTED_PAGES = Counter(
    "halfmoon_decode_evicted_pages_total", "Decode radix-cache pages evicted to make room.",
    registry=_R)
DECODE_KV_CHECKSUM_MISMATCHES = Counter(
    "halfmoon_decode_kv_checksum_mismatches_total",
    "Cached decode pages whose checksum changed when a prefix hit reused them (evicted, recomputed).",
    registry=_R)
DECODE_KV_WAIT_SECONDS = Histogram(
    "halfmoon_decode_kv_wait_seconds",
    "Seconds from pre-allocation to the KV commit (completion notice verified), per request.",
    buckets=KV_WAIT_BUCKETS, registry=_R)
DECODE_QUARANTINE_RELEASES = Counter(
    "halfmoon_decode_quarantine_releases_total",
    "Quarantined destination rooms released, by cause (P's notice, rejected, P proven gone, fence).",
    ["cause"], registry=_R)
DECODE_RETRACTIONS = Counter(
    "halfmoon_decode_retractions_total",
    "Running decode requests retracted because the pool could not grow them, by reason.",
    ["reason"], registry=_R)
DECODE_RESERVE_MISSES = Counter(
    "halfmoon_decode_reserve_misses_total",
    "Decode steps at which a request outgrew its reserve and the pool could not give a page.",
    registry=_R)
DECODE_RESUME_RECOMPUTED_TOKENS = Counter(
    "halfmoon_decode_resume_recomputed_tokens_total",
    "Tokens recomputed on decode (EXTEND) when a retracted request resumed.", registry=_R)
DECODE_LOCAL_PREFILLS = Counter(
    "halfmoon_decode_local_prefills_total",
    "Requests whose prompt the decode worker prefilled itself (no prefill leg).", registry=_R)
DECODE_LOCAL_PREFILL_TOKENS = Counter(
    "halfmoon_decode_local_prefill_tokens_total",
    "Prompt tokens the decode worker computed (EXTEND) for requests it prefilled itself.", registry=_R)
DECODE_PROJECTED_PAGES = Gauge(
    "halfmoon_decode_kv_projected_pages",
    "KV pages the live decode requests are projected to still take.", registry=_R)
DECODE_NEW_TOKEN_RATIO = Gauge(
    "halfmoon_decode_new_token_ratio",
    "Projected share of a request's remaining tokens it will still generate.", registry=_R)
DECODE_STEP_SECONDS = Counter(
    "halfmoon_decode_step_seconds_total",
    "Wall seconds of decode steps (one step's start to the next's), by part: device (forward and "
    "sampling calls) or host (the rest).", ["part"], registry=_R)
DECODE_STEP_REQUESTS = Counter(
    "halfmoon_decode_step_requests_total",
    "Running requests summed over timed decode steps (host seconds / this = host cost per request-step).",
    registry=_R)
DECODE_FINISHED_TOKEN_SHARE = Histogram(
    "halfmoon_decode_finished_token_share",
    "Per decode request that ended by itself: generated / min(max_tokens, projection clip).",
    buckets=SHARE_BUCKETS, registry=_R)

# --- registry -----------------------------------------------------------------------------------
REGISTRY_WORKERS = Gauge(
    "halfmoon_registry_workers", "Live registered workers by role.", ["role"], registry=_R)
REGISTRY_EXPIRED_LEASES = Counter(
    "halfmoon_registry_expired_leases_total", "Segments dropped because their lease expired.",
    registry=_R)
REGISTRY_LOOKUPS = Counter(
    "halfmoon_registry_lookups_total", "GetSegment lookups by result (found, not_found).",
    ["result"], registry=_R)

# Known label values are created up front, so their series exist (at 0) from the first scrape:
# rate() and alerts then work before the first event.
for _reason in TRANSFER_FAILURE_REASONS:
    TRANSFER_FAILURES.labels(reason=_reason)
for _leg in RETRY_LEGS:
    ROUTER_RETRIES.labels(leg=_leg)
for _reason in LOCAL_PREFILL_REASONS:
    ROUTER_LOCAL_PREFILLS.labels(reason=_reason)
for _reason in MIGRATION_REASONS:
    ROUTER_MIGRATIONS.labels(reason=_reason)
for _api in AUTH_APIS:
    for _reason in AUTH_FAILURE_REASONS:
        ROUTER_AUTH_FAILURES.labels(api=_api, reason=_reason)
for _role in WORKER_ROLES:
    REGISTRY_WORKERS.labels(role=_role)
for _result in REGISTRY_LOOKUP_RESULTS:
    REGISTRY_LOOKUPS.labels(result=_result)
for _q in PREFILL_QUEUES:
    PREFILL_QUEUE.labels(queue=_q)
for _part in STEP_PARTS:
    DECODE_STEP_SECONDS.labels(part=_part)
for _q in DECODE_QUEUES:
    DECODE_QUEUE.labels(queue=_q)
for _s in KV_PAGE_STATES:
    DECODE_KV_PAGES.labels(state=_s)
for _c in QUARANTINE_RELEASE_CAUSES:
    DECODE_QUARANTINE_RELEASES.labels(cause=_c)
for _reason in RETRACTION_REASONS:
    DECODE_RETRACTIONS.labels(reason=_reason)



def init_router_series(policy: str, tenants: Iterable[str], statuses: Iterable[str]) -> None:
    """Create the router's per-tenant series at 0 (requests by status, latencies, tokens), so
    rate() and alerts see a tenant's first requests."""
    statuses = tuple(statuses)
    for tenant in tenants:
        for status in statuses:
            ROUTER_REQUESTS.labels(status=status, policy=policy, tenant=tenant)
        for metric in (ROUTER_TTFT, ROUTER_ITL, ROUTER_E2E, ROUTER_PROMPT_TOKENS, ROUTER_COMPLETION_TOKENS):
            metric.labels(tenant=tenant)


METRICS_BY_GROUP: dict[str, tuple] = {
    "router": (ROUTER_REQUESTS, ROUTER_TTFT, ROUTER_ITL, ROUTER_E2E, ROUTER_RETRIES,
               ROUTER_MIGRATIONS, ROUTER_IN_FLIGHT, ROUTER_QUEUED, ROUTER_PROMPT_TOKENS, ROUTER_COMPLETION_TOKENS,
               ROUTER_AUTH_FAILURES, ROUTER_LOCAL_PREFILLS),
    "prefill": (PREFILL_QUEUE, PREFILL_PROMPT_TOKENS, PREFILL_CACHED_TOKENS, PREFILL_BATCH_SIZE,
                PREFILL_BATCH_TOKENS, PREFILL_COMPUTE_SECONDS),
    "transfer": (TRANSFER_PAGES, TRANSFER_RANK_PAGES, TRANSFER_BYTES, TRANSFER_BATCH_SECONDS, TRANSFER_FAILURES),
    "decode": (DECODE_QUEUE, DECODE_RUNNING, DECODE_KV_USAGE, DECODE_KV_PAGES, DECODE_PROMPT_TOKENS,
               DECODE_PREFIX_HIT_TOKENS, DECODE_GENERATED_TOKENS, DECODE_EVICTED_PAGES,
               DECODE_KV_CHECKSUM_MISMATCHES, DECODE_KV_WAIT_SECONDS, DECODE_QUARANTINE_RELEASES,
               DECODE_RETRACTIONS, DECODE_RESERVE_MISSES, DECODE_RESUME_RECOMPUTED_TOKENS,
               DECODE_LOCAL_PREFILLS, DECODE_LOCAL_PREFILL_TOKENS, DECODE_PROJECTED_PAGES, DECODE_NEW_TOKEN_RATIO,
               DECODE_FINISHED_TOKEN_SHARE, DECODE_STEP_SECONDS, DECODE_STEP_REQUESTS),
    "registry": (REGISTRY_WORKERS, REGISTRY_EXPIRED_LEASES, REGISTRY_LOOKUPS),
}
# role of a process -> metric groups it exports (transfer is counted on the sender = prefill).
GROUPS_BY_ROLE: dict[str, tuple[str, ...]] = {
    "router": ("router",),
    "prefill": ("prefill", "transfer"),
    "decode": ("decode",),
    "registry": ("registry",),
}
ROLES = tuple(GROUPS_BY_ROLE)

_servers: list = []


def _version() -> str:
    try:
        return importlib.metadata.version("halfmoon")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_registry(role: str | None = None, *, worker_id: str = "", model: str = "",
                   groups: Iterable[str] | None = None) -> CollectorRegistry:
    """A fresh CollectorRegistry with the metrics a process of ``role`` owns.

    ``role`` ∈ :data:`ROLES` selects groups by :data:`GROUPS_BY_ROLE`; ``groups`` (names in
    :data:`METRICS_BY_GROUP`) overrides that; with neither, every group is exported (tests, tools).
    Sets ``halfmoon_worker_info{role, worker_id, model, version}`` to 1 when ``role`` is given.
    Raises ValueError for an unknown role or group.
    """
    if role is not None and role not in GROUPS_BY_ROLE:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if groups is None:
        groups = GROUPS_BY_ROLE[role] if role is not None else tuple(METRICS_BY_GROUP)
    groups = tuple(groups)
    unknown = [g for g in groups if g not in METRICS_BY_GROUP]
    if unknown:
        raise ValueError(f"unknown metric group(s) {unknown}; known: {tuple(METRICS_BY_GROUP)}")
    reg = CollectorRegistry(auto_describe=True)
    for group in groups:
        for metric in METRICS_BY_GROUP[group]:
            reg.register(metric)
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        reg.register(collector)
    info = Gauge("halfmoon_worker_info", "Identity of this process (value 1).",
                 ["role", "worker_id", "model", "version"], registry=reg)
    if role is not None:
        info.labels(role=role, worker_id=worker_id or f"{role}-{os.getpid()}",
                    model=model, version=_version()).set(1)
    return reg


def start_metrics_server(port: int, host: str | None = None, *, role: str | None = None,
                         worker_id: str = "", model: str = "",
                         groups: Iterable[str] | None = None) -> int:
    """Serve ``/metrics`` (Prometheus text format) on ``host:port`` in a daemon thread.

    ``port`` 0 picks a free port. ``host`` defaults to ``$HALFMOON_METRICS_HOST`` or 127.0.0.1
    (the Helm chart sets the variable to 0.0.0.0 so Prometheus can scrape the pod IP). ``role``,
    ``worker_id``, ``model`` and ``groups``: see :func:`build_registry`. Returns the bound port.
    Raises OSError when the port is taken, ValueError for an unknown role/group.
    """
    host = host or os.environ.get("HALFMOON_METRICS_HOST") or "127.0.0.1"
    registry = build_registry(role, worker_id=worker_id, model=model, groups=groups)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    _servers.append(server)
    return int(server.server_address[1])


def stop_metrics_servers(port: int | None = None) -> None:
    """Shut down the servers started by :func:`start_metrics_server` in this process: every one, or
    only the one bound to ``port``."""
    for server in [s for s in _servers if port is None or s.server_address[1] == port]:
        _servers.remove(server)
        server.shutdown()
        server.server_close()
