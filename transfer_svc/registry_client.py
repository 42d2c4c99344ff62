"""RegistryClient: how a worker publishes itself in the transfer registry and finds its peers.

    reg = RegistryClient("127.0.0.1:50050", worker_id="decode-0", role="decode",
                         grpc_address="127.0.0.1:7001", metrics_address="127.0.0.1:9401",
                         model="smollm2-135m-instruct")
    reg.publish(engine.publish(kv_layout))       # register + heartbeat in a background thread
    desc = reg.get_segment("prefill-0")           # cached; refreshed when the incarnation changes
    engine = TransferEngine(..., resolver=reg)    # lets engine.open_segment("prefill-0") work
    reg.close()                                    # stop heartbeats, unregister

The heartbeat thread renews the lease every ttl/3 seconds; a NOT_FOUND answer (the registry
restarted or the lease expired) makes it register again with the same record (the same segment
descriptor: the registry is only a directory). The lease secret the registry returned is kept in
memory only and sent with every heartbeat, unregister and re-registration (it proves ownership of the
worker id); a PERMISSION_DENIED heartbeat means another process took the id after our lease lapsed:
the client keeps trying to register, which succeeds only once that lease is gone. The segment cache is invalidated by a WatchWorkers
stream (UPDATED / REMOVED events for a name drop its entry) and by `invalidate(name)`, which the
transfer engine calls when a segment fails.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from protos import registry_pb2, registry_pb2_grpc
from security import OPEN, ClusterCredentials

log = logging.getLogger(__name__)

_ROLES = {"prefill": registry_pb2.PREFILL, "decode": registry_pb2.DECODE}


class RegistryClient:
    """A worker's client of the registry (thread-safe).

    Args:
        address: registry gRPC "host:port".
        worker_id: this worker's id (= its segment name).
        role: "prefill" | "decode" (or the WorkerRole enum value).
        grpc_address, metrics_address, model: published in the WorkerRecord.
        ttl_s: lease TTL asked for, seconds (0 = the registry's default).
        rpc_timeout_s: deadline of each unary RPC, seconds.
        watch: keep a WatchWorkers stream to invalidate cached segments on UPDATED/REMOVED.
        credentials: this process's cluster credentials (mTLS and/or the cluster token).
    """

    def __init__(self, address: str, *, worker_id: str = "", role: str | int = "decode",
                 grpc_address: str = "", metrics_address: str = "", model: str = "",
                 ttl_s: int = 10, rpc_timeout_s: float = 2.0, watch: bool = True,
                 credentials: ClusterCredentials = OPEN):
        if isinstance(role, str):
            if role not in _ROLES:
                raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
            role = _ROLES[role]
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
        self.address = address
        self.rpc_timeout_s = rpc_timeout_s
        self.record = registry_pb2.WorkerRecord(worker_id=worker_id, role=role,
                                                grpc_address=grpc_address,
                                                metrics_address=metrics_address, model=model)
        self.ttl_s = ttl_s
        self.lease_id = ""
        self._lease_secret = ""  # never logged
        self.granted_ttl_s = ttl_s or 10
        self._lease_valid_until = float("-inf")
        self.registrations = 0  # how many times this client (re-)registered
        self._channel = credentials.channel(address)
        self._stub = registry_pb2_grpc.RegistryStub(self._channel)
        self._lock = threading.Lock()
        self._cache: dict[str, registry_pb2.WorkerRecord] = {}
        self._stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._watch_call = None
        self._watch_thread: threading.Thread | None = None
        if watch:
            self._watch_thread = threading.Thread(target=self._watch_loop, daemon=True,
                                                  name=f"registry-watch-{worker_id}")
            self._watch_thread.start()

    # ---- publishing
    def publish(self, segment: registry_pb2.SegmentDescriptor | None = None,
                takeover_wait_s: float | None = None) -> str:
        """Register (or update) this worker's record with `segment` -> lease id, and start
        heartbeats.

        While a live lease of another process holds our worker id (we restarted after a SIGKILL:
        the old lease runs until its TTL), registration is PERMISSION_DENIED; it is retried for
        `takeover_wait_s` seconds (default 2 x our TTL + 1). Raises ValueError when the record has
        no worker_id, grpc.RpcError when the registry refuses or cannot be reached."""
        if not self.record.worker_id:
            raise ValueError("publish needs a worker_id")
        with self._lock:
            if segment is not None:
                self.record.segment.CopyFrom(segment)
        if takeover_wait_s is None:
            takeover_wait_s = 2.0 * (self.ttl_s or 10) + 1.0
        deadline = time.monotonic() + takeover_wait_s
        waited = False
        while True:
            try:
                self._register()
                break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.PERMISSION_DENIED or time.monotonic() > deadline:
                    raise
                if not waited:
                    log.info("worker id %s is still held by an earlier lease; waiting for it "
                             "to end", self.record.worker_id)
                    waited = True
                time.sleep(0.25)
        if self._hb_thread is None:
            self._hb_thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                               name=f"registry-heartbeat-{self.record.worker_id}")
            self._hb_thread.start()
        return self.lease_id

    def _register(self) -> None:
        with self._lock:
            req = registry_pb2.RegisterSegmentRequest(worker=self.record, ttl_seconds=self.ttl_s,
                                                      lease_secret=self._lease_secret)
        sent = time.monotonic()
        resp = self._stub.RegisterSegment(req, timeout=self.rpc_timeout_s)
        with self._lock:
            self.lease_id = resp.lease_id
            self._lease_secret = resp.lease_secret
            self.granted_ttl_s = resp.ttl_seconds
            self.registrations += 1
            self._lease_valid_until = sent + resp.ttl_seconds

    def lease_valid_for(self) -> float:
        """Seconds our lease is still certainly held, by our own monotonic clock (negative once it
        may have lapsed; -inf before the first registration).

        Counted from when the last successful register/heartbeat was *sent*, so the registry's
        expiry can only come later. A worker that was stopped (SIGSTOP, a long GC pause) sees its
        lease lapsed on waking, before any heartbeat runs, and must fence itself: the peers may
        already treat its resources as released.
        """
        with self._lock:
            return self._lease_valid_until - time.monotonic()

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(max(0.05, self.granted_ttl_s / 3.0)):
            try:
                sent = time.monotonic()
                with self._lock:
                    req = registry_pb2.HeartbeatRequest(worker_id=self.record.worker_id,
                                                        lease_id=self.lease_id,
                                                        lease_secret=self._lease_secret)
                resp = self._stub.Heartbeat(req, timeout=self.rpc_timeout_s)
                with self._lock:
                    self._lease_valid_until = sent + (resp.ttl_seconds or self.granted_ttl_s)
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return
                if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
                    log.warning("registry lost our lease (%s); registering again", e.details())
                    try:
                        self._register()
                    except grpc.RpcError as e2:
                        log.warning("re-registration failed: %s", e2.code())
                else:
                    log.warning("heartbeat failed: %s", e.code())

    # ---- lookups
    def get_worker(self, name: str, refresh: bool = False) -> registry_pb2.WorkerRecord:
        """The WorkerRecord registered under segment name or worker id `name`. Cached until an
        UPDATED/REMOVED event or invalidate(); refresh=True asks the registry. Raises KeyError when
        the registry has no such name, grpc.RpcError on other failures."""
        if not refresh:
            with self._lock:
                rec = self._cache.get(name)
            if rec is not None:
                return rec
        try:
            resp = self._stub.GetSegment(registry_pb2.GetSegmentRequest(name=name),
                                         timeout=self.rpc_timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                with self._lock:
                    self._cache.pop(name, None)
                raise KeyError(f"registry has no segment named {name!r}") from None
            raise
        with self._lock:
            self._cache[name] = resp.worker
        return resp.worker

    def get_segment(self, name: str, refresh: bool = False) -> registry_pb2.SegmentDescriptor:
        """The SegmentDescriptor of `name` (see get_worker for caching and errors)."""
        rec = self.get_worker(name, refresh)
        if not rec.HasField("segment"):
            raise KeyError(f"worker {name!r} is registered without a segment")
        return rec.segment

    def invalidate(self, name: str) -> None:
        """Forget the cached record of `name` (the next lookup asks the registry)."""
        with self._lock:
            self._cache.pop(name, None)

    def _watch_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._watch_call = self._stub.WatchWorkers(registry_pb2.WatchWorkersRequest())
                for ev in self._watch_call:
                    rec = ev.worker
                    with self._lock:
                        for key in (rec.worker_id, rec.segment.name):
                            cached = self._cache.get(key)
                            if cached is None:
                                continue
                            if (ev.kind == registry_pb2.WorkerEvent.REMOVED
                                    or cached.segment.incarnation != rec.segment.incarnation):
                                del self._cache[key]
            except grpc.RpcError:
                pass
            # stream ended (registry restart or close): anything cached may be stale
            with self._lock:
                self._cache.clear()
            self._stop.wait(0.5)

    # ---- shutdown
    def close(self, unregister: bool = True) -> None:
        """Stop heartbeats and the watch stream; unregister (unless told not to); close the channel."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._watch_call is not None:
            self._watch_call.cancel()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        if unregister and self.lease_id:
            try:
                self._stub.Unregister(registry_pb2.UnregisterRequest(
                    worker_id=self.record.worker_id, lease_id=self.lease_id,
                    lease_secret=self._lease_secret), timeout=self.rpc_timeout_s)
            except grpc.RpcError as e:
                log.warning("unregister failed: %s", e.code())
        if self._watch_thread is not None:
            self._watch_thread.join(timeout=5)
        self._channel.close()

    def __enter__(self) -> "RegistryClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
