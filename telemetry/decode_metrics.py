"""Metrics decode workers own (decode_svc): queues, KV pool, tokens, memory and steps.

The catalog (names, labels, meaning) is the docstring of :mod:`telemetry.metrics`.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from telemetry.label_values import (
    DECODE_QUEUES, KV_PAGE_STATES, QUARANTINE_RELEASE_CAUSES, RETRACTION_REASONS, STEP_PARTS)
from telemetry.buckets import KV_WAIT_BUCKETS, SHARE_BUCKETS

# Created unregistered (registry=None): telemetry.exposition.build_registry attaches them per
# process, so a process exports only the groups its role owns.
_R = None

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
DECODE_TORCH_THREADS = Gauge(
    "halfmoon_decode_torch_threads",
    "Torch intra-op threads the decode worker's forwards run with now (--cpu-share moves it).",
    registry=_R)

# this group's metrics, in exposition order (telemetry.exposition.METRICS_BY_GROUP['decode'])
METRICS = (
    DECODE_QUEUE, DECODE_RUNNING, DECODE_KV_USAGE, DECODE_KV_PAGES, DECODE_PROMPT_TOKENS,
    DECODE_PREFIX_HIT_TOKENS, DECODE_GENERATED_TOKENS, DECODE_EVICTED_PAGES,
    DECODE_KV_CHECKSUM_MISMATCHES, DECODE_KV_WAIT_SECONDS, DECODE_QUARANTINE_RELEASES,
    DECODE_RETRACTIONS, DECODE_RESERVE_MISSES, DECODE_RESUME_RECOMPUTED_TOKENS, DECODE_LOCAL_PREFILLS,
    DECODE_LOCAL_PREFILL_TOKENS, DECODE_PROJECTED_PAGES, DECODE_NEW_TOKEN_RATIO,
    DECODE_FINISHED_TOKEN_SHARE, DECODE_STEP_SECONDS, DECODE_STEP_REQUESTS, DECODE_TORCH_THREADS)

# Known label values are created up front, so their series exist (at 0) from the first scrape:
# rate() and alerts then work before the first event.
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
