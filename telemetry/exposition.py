"""Exposition: which metric groups a process of each role exports, and its ``/metrics`` server.

Every metric is created unregistered in its group's module (``telemetry/<group>_metrics.py``);
:func:`build_registry` attaches a role's groups to a fresh registry, so a process never exports
all-zero series for quantities another service owns.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR
from prometheus_client import disable_created_metrics
from prometheus_client.exposition import start_http_server

from telemetry import decode_metrics, prefill_metrics, registry_metrics, router_metrics, transfer_metrics

# The `*_created` timestamp series only double the exposition in the text format; nothing reads them.
disable_created_metrics()

METRICS_BY_GROUP: dict[str, tuple] = {
    "router": router_metrics.METRICS,
    "prefill": prefill_metrics.METRICS,
    "transfer": transfer_metrics.METRICS,
    "decode": decode_metrics.METRICS,
    "registry": registry_metrics.METRICS,
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
