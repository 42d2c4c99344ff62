"""The transfer registry: gRPC `halfmoon.v1.Registry` (protos/registry.proto).

Workers (prefill / decode) register a WorkerRecord (role, gRPC and metrics addresses, model, and the
SegmentDescriptor of their transfer engine) under a lease; heartbeats renew it, a lease not renewed
within its TTL expires and the record is removed (event REMOVED, reason "lease expired"). Peers look
segments up by name (`GetSegment`) and routers follow membership with `WatchWorkers` (a snapshot as
ADDED events, then ADDED / UPDATED / REMOVED as they happen).

State is in memory: a restarted registry starts empty and workers re-register when their heartbeat
gets NOT_FOUND (RegistryClient does this).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from telemetry import metrics
from protos import registry_pb2, registry_pb2_grpc
from protos.request_guard import InvalidRequestInterceptor
from security import OPEN, ClusterCredentials
from transfer_svc.digest import descriptor_digest

log = logging.getLogger(__name__)

SERVICE_NAME = "halfmoon.v1.Registry"
ROLE_NAMES = {registry_pb2.PREFILL: "prefill", registry_pb2.DECODE: "decode"}
MAX_TTL_S = 3600
MAX_NAME_LEN = 256


@dataclass
class _Entry:
    record: registry_pb2.WorkerRecord
    lease_id: str
    ttl_s: int
    expires_at: float


class RegistryServicer(registry_pb2_grpc.RegistryServicer):
    """In-memory store of worker records with leases, plus watch streams.

    Args:
        default_ttl_s: lease TTL (seconds) when a registration asks for 0.
        reap_interval_s: how often expired leases are looked for.
    """

    def __init__(self, default_ttl_s: int = 10, reap_interval_s: float = 0.2):
        self.default_ttl_s = default_ttl_s
        self._entries: dict[str, _Entry] = {}
        self._by_segment: dict[str, str] = {}  # segment name -> worker id
        self._lock = threading.Lock()
        self._watchers: list[tuple[int, queue.Queue]] = []
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, args=(reap_interval_s,),
                                        name="registry-reaper", daemon=True)
        self._reaper.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for _, q in self._watchers:
                q.put(None)

    # ---- internals (call with _lock held)
    def _emit(self, kind, record, reason: str = "") -> None:
        ev = registry_pb2.WorkerEvent(kind=kind, worker=record, reason=reason)
        for role, q in self._watchers:
            if role in (registry_pb2.ROLE_UNSPECIFIED, record.role):
                q.put(ev)

    def _update_gauges(self) -> None:
        for role, name in ROLE_NAMES.items():
            metrics.REGISTRY_WORKERS.labels(role=name).set(
                sum(1 for e in self._entries.values() if e.record.role == role))

    def _remove(self, worker_id: str, reason: str) -> None:
        e = self._entries.pop(worker_id)
        if e.record.segment.name and self._by_segment.get(e.record.segment.name) == worker_id:
            del self._by_segment[e.record.segment.name]
        self._emit(registry_pb2.WorkerEvent.REMOVED, e.record, reason)
        self._update_gauges()

    def _reap_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            now = time.monotonic()
            with self._lock:
                for wid in [w for w, e in self._entries.items() if e.expires_at < now]:
                    log.info("lease of worker %s expired", wid)
                    self._remove(wid, "lease expired")
                    metrics.REGISTRY_EXPIRED_LEASES.inc()

    @staticmethod
    def _validate(worker: registry_pb2.WorkerRecord) -> str | None:
        if not worker.worker_id:
            return "worker.worker_id is required"
        if len(worker.worker_id) > MAX_NAME_LEN:
            return f"worker.worker_id is longer than {MAX_NAME_LEN} characters"
        if worker.role not in ROLE_NAMES:
            return "worker.role must be PREFILL or DECODE"
        seg = worker.segment
        if worker.HasField("segment"):
            if not seg.name:
                return "worker.segment.name is required when a segment is given"
            if not seg.incarnation:
                return "worker.segment.incarnation is required"
            if not seg.worker_address:
                return "worker.segment.worker_address is required"
            for i, r in enumerate(seg.regions):
                if r.length == 0 or not r.rkey:
                    return f"worker.segment.regions[{i}] needs a length > 0 and an rkey"
            if seg.digest != descriptor_digest(seg):
                return "worker.segment.digest does not match its contents (corrupted descriptor)"
        return None

    # ---- RPCs
    def RegisterSegment(self, request, context):
        err = self._validate(request.worker)
        if err is None and not (0 <= request.ttl_seconds <= MAX_TTL_S):
            err = f"ttl_seconds must be in [0, {MAX_TTL_S}]"
        if err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        ttl = request.ttl_seconds or self.default_ttl_s
        rec = registry_pb2.WorkerRecord()
        rec.CopyFrom(request.worker)
        wid = rec.worker_id
        with self._lock:
            seg_name = rec.segment.name
            owner = self._by_segment.get(seg_name) if seg_name else None
            if owner is not None and owner != wid:
                context.abort(grpc.StatusCode.ALREADY_EXISTS,
                              f"segment {seg_name!r} is registered by worker {owner!r}")
            old = self._entries.get(wid)
            lease = uuid.uuid4().hex
            self._entries[wid] = _Entry(rec, lease, ttl, time.monotonic() + ttl)
            if old is not None and old.record.segment.name and old.record.segment.name != seg_name:
                self._by_segment.pop(old.record.segment.name, None)
            if seg_name:
                self._by_segment[seg_name] = wid
            kind = registry_pb2.WorkerEvent.ADDED if old is None else registry_pb2.WorkerEvent.UPDATED
            self._emit(kind, rec)
            self._update_gauges()
        return registry_pb2.RegisterSegmentResponse(lease_id=lease, ttl_seconds=ttl)

    def GetSegment(self, request, context):
        if not request.name:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name is required")
        with self._lock:
            wid = self._by_segment.get(request.name, request.name)
            e = self._entries.get(wid)
            rec = None if e is None else e.record
        if rec is None:
            metrics.REGISTRY_LOOKUPS.labels(result="not_found").inc()
            context.abort(grpc.StatusCode.NOT_FOUND, f"no segment or worker named {request.name!r}")
        metrics.REGISTRY_LOOKUPS.labels(result="found").inc()
        return registry_pb2.GetSegmentResponse(worker=rec)

    def Heartbeat(self, request, context):
        if not request.worker_id or not request.lease_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id and lease_id are required")
        with self._lock:
            e = self._entries.get(request.worker_id)
            if e is not None and e.lease_id == request.lease_id:
                e.expires_at = time.monotonic() + e.ttl_s
                return registry_pb2.HeartbeatResponse(ttl_seconds=e.ttl_s)
        context.abort(grpc.StatusCode.NOT_FOUND,
                      f"no lease {request.lease_id!r} for worker {request.worker_id!r}: register again")

    def Unregister(self, request, context):
        if not request.worker_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id is required")
        with self._lock:
            e = self._entries.get(request.worker_id)
            if e is None or (request.lease_id and e.lease_id != request.lease_id):
                return registry_pb2.UnregisterResponse(found=False)
            self._remove(request.worker_id, "unregistered")
        return registry_pb2.UnregisterResponse(found=True)

    def WatchWorkers(self, request, context):
        if request.role not in (registry_pb2.ROLE_UNSPECIFIED, *ROLE_NAMES):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "role must be PREFILL, DECODE or unset")
        q: queue.Queue = queue.Queue()
        item = (request.role, q)
        with self._lock:
            snapshot = [e.record for e in self._entries.values()
                        if request.role in (registry_pb2.ROLE_UNSPECIFIED, e.record.role)]
            self._watchers.append(item)
        context.add_callback(lambda: q.put(None))
        try:
            for rec in snapshot:
                yield registry_pb2.WorkerEvent(kind=registry_pb2.WorkerEvent.ADDED, worker=rec)
            while context.is_active() and not self._stop.is_set():
                try:
                    ev = q.get(timeout=1.0)
                except queue.Empty:
                    continue
                if ev is None:
                    break
                yield ev
        finally:
            with self._lock:
                if item in self._watchers:
                    self._watchers.remove(item)


def serve(host: str = "127.0.0.1", port: int = 0, *, default_ttl_s: int = 10,
          max_workers: int = 256, credentials: ClusterCredentials = OPEN,
          ) -> tuple[grpc.Server, RegistryServicer, int]:
    """Start the registry gRPC server (with grpc.health.v1 and reflection) -> (server, servicer,
    bound port). Each open WatchWorkers stream holds one of `max_workers` threads (every
    RegistryClient keeps one), so size it above the number of workers + routers. `credentials`:
    mTLS and/or the cluster token every caller must present (records carry rkeys: docs/security.md)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix="registry"),
                         interceptors=[*credentials.server_interceptors(), InvalidRequestInterceptor()])
    servicer = RegistryServicer(default_ttl_s=default_ttl_s)
    registry_pb2_grpc.add_RegistryServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (registry_pb2.DESCRIPTOR.services_by_name["Registry"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = credentials.add_port(server, f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, servicer, bound
