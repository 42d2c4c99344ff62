"""The transfer registry: gRPC `halfmoon.v1.Registry` (protos/registry.proto).

Workers (prefill / decode) register a WorkerRecord (role, gRPC and metrics addresses, model, and the
SegmentDescriptor of their transfer engine) under a lease; heartbeats renew it, a lease not renewed
within its TTL expires and the record is removed (event REMOVED, reason "lease expired"). Peers look
segments up by name (`GetSegment`) and routers follow membership with `WatchWorkers` (a snapshot as
ADDED events, then ADDED / UPDATED / REMOVED as they happen).

Ownership: a registration returns a random lease secret; Heartbeat, Unregister and a replacement of
a live record need it (PERMISSION_DENIED otherwise, the record unchanged). Only its sha256 is stored
and compared (constant time); it is never logged. Once a lease is gone anyone may register that
worker id again, as a new record (REMOVED, then ADDED) with a new secret.

This service is the one place of these rules; where the records live is a `RegistryBackend`
(memory by default, or etcd: registry_backend.py).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import queue
import secrets
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from telemetry import metrics
from protos import registry_pb2, registry_pb2_grpc
from protos.request_guard import InvalidRequestInterceptor
from security import OPEN, ClusterCredentials
from transfer_svc.digest import descriptor_digest
from transfer_svc.registry_backend import BackendUnavailable, Conflict, Held, RegistryBackend
from transfer_svc.registry_watch import ROLE_NAMES

log = logging.getLogger(__name__)

SERVICE_NAME = "halfmoon.v1.Registry"
MAX_TTL_S = 3600
MAX_NAME_LEN = 256
_CAS_ATTEMPTS = 3


def _sha256(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def _owns(held: Held, secret: str) -> bool:
    """Whether `secret` is held's lease secret (constant time; an empty secret never is)."""
    return bool(secret) and hmac.compare_digest(_sha256(secret), held.secret_sha256)


class RegistryServicer(registry_pb2_grpc.RegistryServicer):
    """Validation and ownership over a backend's records, plus watch streams.

    Args:
        default_ttl_s: lease TTL (seconds) when a registration asks for 0.
        backend: where records live (default: a MemoryBackend).
    """

    def __init__(self, default_ttl_s: int = 10, backend: RegistryBackend | None = None):
        if backend is None:
            from transfer_svc.registry_memory import MemoryBackend
            backend = MemoryBackend()
        self.default_ttl_s = default_ttl_s
        self.backend = backend
        self._stopped = False

    def stop(self) -> None:
        self._stopped = True
        self.backend.close()

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
            if len(seg.name) > MAX_NAME_LEN:
                return f"worker.segment.name is longer than {MAX_NAME_LEN} characters"
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

    def _store(self, context, fn, *args):
        try:
            return fn(*args)
        except BackendUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"registry store unavailable: {e}")

    # ---- RPCs
    def RegisterSegment(self, request, context):
        err = self._validate(request.worker)
        if err is None and not (0 <= request.ttl_seconds <= MAX_TTL_S):
            err = f"ttl_seconds must be in [0, {MAX_TTL_S}]"
        if err is None and len(request.lease_secret) > MAX_NAME_LEN:
            err = f"lease_secret is longer than {MAX_NAME_LEN} characters"
        if err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        ttl = request.ttl_seconds or self.default_ttl_s
        rec = registry_pb2.WorkerRecord()
        rec.CopyFrom(request.worker)
        wid, seg_name = rec.worker_id, rec.segment.name
        for _ in range(_CAS_ATTEMPTS):
            held = self._store(context, self.backend.list)
            for h in held:
                if seg_name and h.record.worker_id != wid and seg_name in (
                        h.record.segment.name, h.record.worker_id):
                    context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                  f"segment {seg_name!r} is registered by worker "
                                  f"{h.record.worker_id!r}")
            prev = next((h for h in held if h.record.worker_id == wid), None)
            if prev is None:
                secret = secrets.token_urlsafe(32)
            elif _owns(prev, request.lease_secret):
                secret = request.lease_secret
            else:
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"worker id {wid!r} is held by a live lease: only its owner "
                              "(lease_secret) may replace it, or anyone once the lease is gone")
            try:
                new = self._store(context, self.backend.put, rec, _sha256(secret), ttl, prev)
            except Conflict:
                continue  # changed meanwhile: decide again on what is there now
            return registry_pb2.RegisterSegmentResponse(lease_id=new.lease_id, ttl_seconds=ttl,
                                                        lease_secret=secret)
        context.abort(grpc.StatusCode.ABORTED,
                      f"worker id {wid!r} changed during registration; try again")

    def GetSegment(self, request, context):
        if not request.name:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name is required")
        held = self._store(context, self.backend.get, request.name)
        if held is None:
            held = next((h for h in self._store(context, self.backend.list)
                         if h.record.segment.name == request.name), None)
        if held is None:
            metrics.REGISTRY_LOOKUPS.labels(result="not_found").inc()
            context.abort(grpc.StatusCode.NOT_FOUND, f"no segment or worker named {request.name!r}")
        metrics.REGISTRY_LOOKUPS.labels(result="found").inc()
        return registry_pb2.GetSegmentResponse(worker=held.record)

    def _owned(self, request, context) -> Held | None:
        """The live record of request.worker_id if the caller owns it; None if there is none;
        PERMISSION_DENIED when the secret is wrong or missing."""
        held = self._store(context, self.backend.get, request.worker_id)
        if held is not None and not _owns(held, request.lease_secret):
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"lease_secret does not match the lease of worker {request.worker_id!r}")
        return held

    def Heartbeat(self, request, context):
        if not request.worker_id or not request.lease_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id and lease_id are required")
        held = self._owned(request, context)
        if held is not None and held.lease_id == request.lease_id:
            ttl = self._store(context, self.backend.renew, held)
            if ttl is not None:
                return registry_pb2.HeartbeatResponse(ttl_seconds=ttl)
        context.abort(grpc.StatusCode.NOT_FOUND,
                      f"no lease {request.lease_id!r} for worker {request.worker_id!r}: register again")

    def Unregister(self, request, context):
        if not request.worker_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id is required")
        held = self._owned(request, context)
        if held is None or (request.lease_id and held.lease_id != request.lease_id):
            return registry_pb2.UnregisterResponse(found=False)
        return registry_pb2.UnregisterResponse(found=self._store(context, self.backend.delete, held))

    def WatchWorkers(self, request, context):
        if request.role not in (registry_pb2.ROLE_UNSPECIFIED, *ROLE_NAMES):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "role must be PREFILL, DECODE or unset")
        snapshot, q = self.backend.hub.subscribe(request.role)
        context.add_callback(lambda: q.put(None))
        try:
            for rec in snapshot:
                yield registry_pb2.WorkerEvent(kind=registry_pb2.WorkerEvent.ADDED, worker=rec)
            while context.is_active() and not self._stopped:
                try:
                    ev = q.get(timeout=1.0)
                except queue.Empty:
                    continue
                if ev is None:
                    break
                yield ev
        finally:
            self.backend.hub.unsubscribe(q)


def serve(host: str = "127.0.0.1", port: int = 0, *, default_ttl_s: int = 10,
          max_workers: int = 256, backend: RegistryBackend | None = None,
          credentials: ClusterCredentials = OPEN) -> tuple[grpc.Server, RegistryServicer, int]:
    """Start the registry gRPC server (with grpc.health.v1 and reflection) over `backend` (default:
    in memory) -> (server, servicer, bound port). Each open WatchWorkers stream holds one of
    `max_workers` threads (every RegistryClient keeps one), so size it above the number of
    workers + routers. `credentials`: mTLS and/or the cluster token every caller must present
    (records carry rkeys: docs/security.md)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix="registry"),
                         interceptors=[*credentials.server_interceptors(), InvalidRequestInterceptor()])
    servicer = RegistryServicer(default_ttl_s=default_ttl_s, backend=backend)
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
