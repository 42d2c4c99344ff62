"""Metrics the registry service owns (transfer_svc registry, ``halfmoon serve-transfer``).

The catalog (names, labels, meaning) is the docstring of :mod:`telemetry.metrics`.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from telemetry.label_values import WORKER_ROLES, REGISTRY_LOOKUP_RESULTS

# Created unregistered (registry=None): telemetry.exposition.build_registry attaches them per
# process, so a process exports only the groups its role owns.
_R = None

REGISTRY_WORKERS = Gauge(
    "halfmoon_registry_workers", "Live registered workers by role.", ["role"], registry=_R)
REGISTRY_EXPIRED_LEASES = Counter(
    "halfmoon_registry_expired_leases_total", "Segments dropped because their lease expired.",
    registry=_R)
REGISTRY_LOOKUPS = Counter(
    "halfmoon_registry_lookups_total", "GetSegment lookups by result (found, not_found).",
    ["result"], registry=_R)

# this group's metrics, in exposition order (telemetry.exposition.METRICS_BY_GROUP['registry'])
METRICS = (
    REGISTRY_WORKERS, REGISTRY_EXPIRED_LEASES, REGISTRY_LOOKUPS)

# Known label values are created up front, so their series exist (at 0) from the first scrape:
# rate() and alerts then work before the first event.
for _role in WORKER_ROLES:
    REGISTRY_WORKERS.labels(role=_role)
for _result in REGISTRY_LOOKUP_RESULTS:
    REGISTRY_LOOKUPS.labels(result=_result)
