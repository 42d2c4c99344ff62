"""Metrics of the transfer engine (transfer_svc), counted on the sender: the prefill process.

The catalog (names, labels, meaning) is the docstring of :mod:`telemetry.metrics`.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from telemetry.label_values import TRANSFER_FAILURE_REASONS
from telemetry.buckets import TRANSFER_BUCKETS

# Created unregistered (registry=None): telemetry.exposition.build_registry attaches them per
# process, so a process exports only the groups its role owns.
_R = None

TRANSFER_PAGES = Counter(
    "halfmoon_transfer_pages_total", "KV pages written to decode peers (sender side).", registry=_R)
TRANSFER_BYTES = Counter(
    "halfmoon_transfer_bytes_total", "KV bytes written to decode peers (sender side).", registry=_R)
TRANSFER_BATCH_SECONDS = Histogram(
    "halfmoon_transfer_batch_seconds",
    "Seconds from submitting one transfer batch to completion of all its writes.",
    buckets=TRANSFER_BUCKETS, registry=_R)
TRANSFER_RANK_PAGES = Counter(
    "halfmoon_transfer_rank_pages_total",
    "KV pages submitted per (prefill rank, decode rank) pair (each moves its kv-head slice of the "
    "page; without tensor parallelism every page is rank 0 -> rank 0).", ["src_rank", "dst_rank"], registry=_R)
TRANSFER_FAILURES = Counter(
    "halfmoon_transfer_failures_total", "Failed transfer batches by reason (sender side).",
    ["reason"], registry=_R)

# this group's metrics, in exposition order (telemetry.exposition.METRICS_BY_GROUP['transfer'])
METRICS = (
    TRANSFER_PAGES, TRANSFER_RANK_PAGES, TRANSFER_BYTES, TRANSFER_BATCH_SECONDS, TRANSFER_FAILURES)

# Known label values are created up front, so their series exist (at 0) from the first scrape:
# rate() and alerts then work before the first event.
for _reason in TRANSFER_FAILURE_REASONS:
    TRANSFER_FAILURES.labels(reason=_reason)
