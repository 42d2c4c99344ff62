"""Metrics prefill workers own (prefill_svc): stages, prompt and cached tokens, forward batches.

The catalog (names, labels, meaning) is the docstring of :mod:`telemetry.metrics`.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from telemetry.label_values import PREFILL_QUEUES
from telemetry.buckets import BATCH_REQUEST_BUCKETS, BATCH_TOKEN_BUCKETS, COMPUTE_BUCKETS

# Created unregistered (registry=None): telemetry.exposition.build_registry attaches them per
# process, so a process exports only the groups its role owns.
_R = None

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
PREFILL_TORCH_THREADS = Gauge(
    "halfmoon_prefill_torch_threads",
    "Torch intra-op threads the prefill worker's forwards run with now (--cpu-share moves it).",
    registry=_R)

# this group's metrics, in exposition order (telemetry.exposition.METRICS_BY_GROUP['prefill'])
METRICS = (
    PREFILL_QUEUE, PREFILL_PROMPT_TOKENS, PREFILL_CACHED_TOKENS, PREFILL_BATCH_SIZE,
    PREFILL_BATCH_TOKENS, PREFILL_COMPUTE_SECONDS, PREFILL_TORCH_THREADS)

# Known label values are created up front, so their series exist (at 0) from the first scrape:
# rate() and alerts then work before the first event.
for _q in PREFILL_QUEUES:
    PREFILL_QUEUE.labels(queue=_q)
