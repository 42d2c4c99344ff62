"""The documented label-value sets of the metric catalog (use these constants, not string literals).

Each metric's known values are created at 0 where the metric is defined, so rate() and alerts
work before the first event.
"""

from __future__ import annotations

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
