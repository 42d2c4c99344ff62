"""The transfer registry (`halfmoon serve-transfer`) as a real process on loopback."""

from __future__ import annotations

import os
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos import registry_pb2, registry_pb2_grpc
from transfer_svc.digest import descriptor_digest
from transfer_svc.registry_client import RegistryClient

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RegistryProc:
    def __init__(self, port: int = 0, ttl: int = 2, extra: tuple[str, ...] = ()):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "halfmoon", "serve-transfer", "--port", str(port),
             "--metrics-port", "0", "--ttl", str(ttl), "--log-level", "WARNING", *extra],
            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        r, _, _ = select.select([self.proc.stdout], [], [], 30)
        assert r, "registry did not start"
        line = self.proc.stdout.readline()
        m = re.search(r"grpc=(\S+):(\d+) metrics=(\d+)", line)
        assert m, line
        self.port = int(m.group(2))
        self.address = f"127.0.0.1:{self.port}"
        self.metrics_port = int(m.group(3))
        self.channel = grpc.insecure_channel(self.address)
        self.stub = registry_pb2_grpc.RegistryStub(self.channel)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def stop(self, sig=signal.SIGTERM) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture
def registry():
    r = RegistryProc()
    yield r
    r.stop()


def _segment(name: str, incarnation: str = "inc-1") -> registry_pb2.SegmentDescriptor:
    d = registry_pb2.SegmentDescriptor(name=name, incarnation=incarnation,
                                       worker_address=b"\x01" * 32)
    d.regions.add(base=0x10000, length=4096, rkey=b"\x02" * 16, location="cpu")
    d.digest = descriptor_digest(d)
    return d


def _record(wid: str, role=registry_pb2.DECODE, incarnation="inc-1") -> registry_pb2.WorkerRecord:
    return registry_pb2.WorkerRecord(worker_id=wid, role=role, grpc_address="127.0.0.1:1",
                                     metrics_address="127.0.0.1:2", model="m",
                                     segment=_segment(wid, incarnation))


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def _watch(stub, role=registry_pb2.ROLE_UNSPECIFIED):
    events: queue.Queue = queue.Queue()
    call = stub.WatchWorkers(registry_pb2.WatchWorkersRequest(role=role))

    def pump():
        try:
            for ev in call:
                events.put(ev)
        except grpc.RpcError:
            pass

    threading.Thread(target=pump, daemon=True).start()
    return call, events


def _next(events: queue.Queue, timeout=5.0):
    return events.get(timeout=timeout)


def test_health_reflection_metrics(registry):
    health = health_pb2_grpc.HealthStub(registry.channel)
    for svc in ("", "halfmoon.v1.Registry"):
        assert health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(registry.channel)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]), timeout=5))
    names = {s.name for s in resp.list_services_response.service}
    assert {"halfmoon.v1.Registry", "grpc.health.v1.Health"} <= names
    text = registry.metrics()
    assert _metric(text, "halfmoon_registry_workers", '{role="decode"}') == 0
    assert 'halfmoon_worker_info{' in text and 'role="registry"' in text


def test_register_lookup_watch_update_unregister(registry):
    stub = registry.stub
    lease = stub.RegisterSegment(registry_pb2.RegisterSegmentRequest(
        worker=_record("d0"), ttl_seconds=30), timeout=5)
    assert lease.lease_id and lease.ttl_seconds == 30
    call, events = _watch(stub)
    ev = _next(events)  # snapshot first
    assert ev.kind == registry_pb2.WorkerEvent.ADDED and ev.worker.worker_id == "d0"
    stub.RegisterSegment(registry_pb2.RegisterSegmentRequest(
        worker=_record("p0", registry_pb2.PREFILL)), timeout=5)
    ev = _next(events)
    assert ev.kind == registry_pb2.WorkerEvent.ADDED and ev.worker.role == registry_pb2.PREFILL

    got = stub.GetSegment(registry_pb2.GetSegmentRequest(name="d0"), timeout=5).worker
    assert got == _record("d0")
    with pytest.raises(grpc.RpcError) as e:
        stub.GetSegment(registry_pb2.GetSegmentRequest(name="nobody"), timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND

    # restart of d0: a new incarnation replaces the record -> UPDATED
    lease2 = stub.RegisterSegment(registry_pb2.RegisterSegmentRequest(
        worker=_record("d0", incarnation="inc-2"), lease_secret=lease.lease_secret), timeout=5)
    assert lease2.lease_secret == lease.lease_secret  # the owner keeps its secret
    ev = _next(events)
    assert ev.kind == registry_pb2.WorkerEvent.UPDATED
    assert ev.worker.segment.incarnation == "inc-2"
    # the old lease no longer heartbeats or unregisters the new record
    secret = lease.lease_secret
    with pytest.raises(grpc.RpcError) as e:
        stub.Heartbeat(registry_pb2.HeartbeatRequest(worker_id="d0", lease_id=lease.lease_id,
                                                     lease_secret=secret), timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert not stub.Unregister(registry_pb2.UnregisterRequest(
        worker_id="d0", lease_id=lease.lease_id, lease_secret=secret), timeout=5).found
    assert stub.Heartbeat(registry_pb2.HeartbeatRequest(
        worker_id="d0", lease_id=lease2.lease_id, lease_secret=secret), timeout=5).ttl_seconds == 2

    text = registry.metrics()
    assert _metric(text, "halfmoon_registry_workers", '{role="decode"}') == 1
    assert _metric(text, "halfmoon_registry_workers", '{role="prefill"}') == 1
    assert _metric(text, "halfmoon_registry_lookups_total", '{result="found"}') == 1
    assert _metric(text, "halfmoon_registry_lookups_total", '{result="not_found"}') == 1

    assert stub.Unregister(registry_pb2.UnregisterRequest(
        worker_id="d0", lease_id=lease2.lease_id, lease_secret=secret), timeout=5).found
    ev = _next(events)
    assert ev.kind == registry_pb2.WorkerEvent.REMOVED and ev.reason == "unregistered"
    assert _metric(registry.metrics(), "halfmoon_registry_workers", '{role="decode"}') == 0

    # a role-filtered watch sees only its role
    call2, events2 = _watch(stub, registry_pb2.DECODE)
    stub.RegisterSegment(registry_pb2.RegisterSegmentRequest(worker=_record("d1")), timeout=5)
    assert _next(events2).worker.worker_id == "d1"  # p0 (prefill) not in the snapshot
    call.cancel()
    call2.cancel()


def test_lease_expiry_removes_worker(registry):
    stub = registry.stub
    call, events = _watch(stub)
    lease = stub.RegisterSegment(registry_pb2.RegisterSegmentRequest(
        worker=_record("d0"), ttl_seconds=1), timeout=5)
    assert _next(events).kind == registry_pb2.WorkerEvent.ADDED
    t0 = time.monotonic()
    ev = _next(events, timeout=5)  # no heartbeats
    assert ev.kind == registry_pb2.WorkerEvent.REMOVED and ev.reason == "lease expired"
    assert 0.8 < time.monotonic() - t0 < 5.0
    with pytest.raises(grpc.RpcError) as e:
        stub.GetSegment(registry_pb2.GetSegmentRequest(name="d0"), timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        stub.Heartbeat(registry_pb2.HeartbeatRequest(worker_id="d0", lease_id=lease.lease_id,
                                                     lease_secret=lease.lease_secret), timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert _metric(registry.metrics(), "halfmoon_registry_expired_leases_total") == 1
    call.cancel()


def test_invalid_requests_get_clear_status(registry):
    stub = registry.stub

    def code_of(fn, req):
        with pytest.raises(grpc.RpcError) as e:
            fn(req, timeout=5)
        return e.value.code(), e.value.details()

    R = registry_pb2.RegisterSegmentRequest
    code, details = code_of(stub.RegisterSegment, R(worker=registry_pb2.WorkerRecord(
        role=registry_pb2.DECODE)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "worker_id" in details
    rec = _record("d0")
    rec.role = registry_pb2.ROLE_UNSPECIFIED
    code, details = code_of(stub.RegisterSegment, R(worker=rec))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "role" in details
    rec = _record("d0")
    rec.segment.worker_address = b"\x03" * 32  # digest no longer matches
    code, details = code_of(stub.RegisterSegment, R(worker=rec))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "digest" in details
    code, details = code_of(stub.RegisterSegment, R(worker=_record("d0"), ttl_seconds=10**6))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "ttl_seconds" in details
    code, _ = code_of(stub.GetSegment, registry_pb2.GetSegmentRequest())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = code_of(stub.Heartbeat, registry_pb2.HeartbeatRequest(worker_id="d0"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    # a segment name held by another worker
    stub.RegisterSegment(R(worker=_record("d0")), timeout=5)
    rec = _record("d1")
    rec.segment.CopyFrom(_segment("d0"))
    code, details = code_of(stub.RegisterSegment, R(worker=rec))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "d0" in details
    # the registry still serves
    assert stub.GetSegment(registry_pb2.GetSegmentRequest(name="d0"), timeout=5).worker.worker_id == "d0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_client_heartbeats_and_reregisters_after_registry_restart():
    port = _free_port()
    reg = RegistryProc(port=port, ttl=2)
    client = RegistryClient(reg.address, worker_id="d0", role="decode", ttl_s=1,
                            grpc_address="127.0.0.1:7000", model="m")
    other = RegistryClient(reg.address, worker_id="p0", role="prefill")
    try:
        client.publish(_segment("d0"))
        time.sleep(2.5)  # > TTL: only heartbeats keep it
        assert other.get_segment("d0", refresh=True).incarnation == "inc-1"
        reg.stop(signal.SIGKILL)
        reg = RegistryProc(port=port, ttl=2)  # empty registry on the same address
        deadline = time.monotonic() + 10
        while True:
            try:
                got = other.get_worker("d0", refresh=True)
                break
            except (KeyError, grpc.RpcError):
                assert time.monotonic() < deadline, "worker did not re-register"
                time.sleep(0.2)
        assert got.grpc_address == "127.0.0.1:7000" and got.segment.incarnation == "inc-1"
        assert client.registrations >= 2
        client.close()  # unregisters
        with pytest.raises(KeyError):
            other.get_segment("d0", refresh=True)
    finally:
        client.close()
        other.close()
        reg.stop()


def test_client_cache_follows_incarnation(registry):
    watcher = RegistryClient(registry.address, worker_id="p0", role="prefill")
    owner = RegistryClient(registry.address, worker_id="d0", role="decode", watch=False)
    try:
        owner.publish(_segment("d0", "inc-1"))
        assert watcher.get_segment("d0").incarnation == "inc-1"
        owner.publish(_segment("d0", "inc-2"))  # UPDATED event drops the cached entry
        deadline = time.monotonic() + 5
        while watcher.get_segment("d0").incarnation != "inc-2":
            assert time.monotonic() < deadline, "cache kept the old incarnation"
            time.sleep(0.05)
        with pytest.raises(KeyError):
            watcher.get_segment("nobody")
    finally:
        owner.close()
        watcher.close()


def test_client_lease_view_lapses_when_heartbeats_stop(registry):
    """A worker's own view of its lease: renewed by heartbeats, lapsed (negative) once they stop for
    longer than the TTL — what a prefill worker checks before it writes into a peer's pages."""
    client = RegistryClient(registry.address, worker_id="p0", role="prefill", ttl_s=1)
    try:
        assert client.lease_valid_for() == float("-inf")  # never registered: no lease
        client.publish(_segment("p0"))
        for _ in range(3):  # heartbeats keep it above zero across several TTLs
            time.sleep(0.6)
            assert 0 < client.lease_valid_for() <= 1.0
        client._stop.set()  # heartbeats stop, as in a stopped process
        client._hb_thread.join(timeout=5)
        time.sleep(1.1)
        assert client.lease_valid_for() < 0
    finally:
        client.close()
