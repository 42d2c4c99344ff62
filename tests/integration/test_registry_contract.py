"""The registry contract, run against both backends (memory, etcd): a real `halfmoon serve-transfer`
process, and for etcd a real etcd (Debian's etcd-server) started here on loopback with its own data
dir. One registry per backend serves the module; every test uses worker ids of its own."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import time
import uuid

import grpc
import pytest

from halfmoon.etcd_local import LocalEtcd, etcd_binary
from protos import registry_pb2 as pb
from tests.integration.test_registry import ROOT, RegistryProc, _free_port, _record, _segment, _watch
from transfer_svc.registry_client import RegistryClient

BACKENDS = ["memory", "etcd"]
_Ev = pb.WorkerEvent


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    if etcd_binary() is None:
        pytest.fail("etcd is not installed: run scripts/install-tools.sh")
    e = LocalEtcd(tmp_path_factory.mktemp("etcd") / "data")
    yield e
    e.stop()


def _backend_args(backend: str, etcd, prefix: str) -> tuple[str, ...]:
    if backend == "memory":
        return ()
    return ("--registry-backend", "etcd", "--etcd-endpoints", etcd.endpoint,
            "--etcd-prefix", prefix)


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def reg(backend, request):
    etcd = request.getfixturevalue("etcd") if backend == "etcd" else None
    r = RegistryProc(ttl=2, extra=_backend_args(backend, etcd, f"/hm-{uuid.uuid4().hex[:6]}/"))
    yield r
    r.stop()


def _wid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def _register(stub, rec, ttl=30, secret=""):
    return stub.RegisterSegment(pb.RegisterSegmentRequest(worker=rec, ttl_seconds=ttl,
                                                          lease_secret=secret), timeout=5)


def _code(fn, req) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn(req, timeout=5)
    return e.value.code()


def _events_of(events: queue.Queue, wid: str, n: int, timeout=6.0) -> list:
    """The next n events about worker `wid` (other tests' workers share the registry)."""
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n:
        ev = events.get(timeout=max(0.01, deadline - time.monotonic()))
        if ev.worker.worker_id == wid:
            out.append(ev)
    return out


def test_register_resolve_heartbeat(reg):
    wid = _wid("d")
    lease = _register(reg.stub, _record(wid), ttl=30)
    assert lease.lease_id and lease.ttl_seconds == 30 and len(lease.lease_secret) >= 32
    assert reg.stub.GetSegment(pb.GetSegmentRequest(name=wid), timeout=5).worker == _record(wid)
    hb = reg.stub.Heartbeat(pb.HeartbeatRequest(worker_id=wid, lease_id=lease.lease_id,
                                                lease_secret=lease.lease_secret), timeout=5)
    assert hb.ttl_seconds == 30
    assert _code(reg.stub.GetSegment, pb.GetSegmentRequest(name=_wid("nobody"))) == \
        grpc.StatusCode.NOT_FOUND


def test_heartbeat_and_unregister_need_the_secret(reg):
    wid = _wid("d")
    lease = _register(reg.stub, _record(wid))
    for secret in ("", "not-the-secret", lease.lease_secret[:-1]):
        assert _code(reg.stub.Heartbeat, pb.HeartbeatRequest(
            worker_id=wid, lease_id=lease.lease_id, lease_secret=secret)) == \
            grpc.StatusCode.PERMISSION_DENIED
        for lease_id in ("", lease.lease_id):
            assert _code(reg.stub.Unregister, pb.UnregisterRequest(
                worker_id=wid, lease_id=lease_id, lease_secret=secret)) == \
                grpc.StatusCode.PERMISSION_DENIED
    # still there, still the owner's
    assert reg.stub.GetSegment(pb.GetSegmentRequest(name=wid), timeout=5).worker == _record(wid)
    assert reg.stub.Unregister(pb.UnregisterRequest(worker_id=wid,
                                                    lease_secret=lease.lease_secret), timeout=5).found


def test_hijack_is_refused_and_changes_nothing(reg):
    wid = _wid("d")
    call, events = _watch(reg.stub)
    lease = _register(reg.stub, _record(wid))
    assert _events_of(events, wid, 1)[0].kind == _Ev.ADDED
    fake = _record(wid, incarnation="evil")
    fake.grpc_address = "127.0.0.1:6666"
    for secret in ("", "guess"):
        assert _code(reg.stub.RegisterSegment, pb.RegisterSegmentRequest(
            worker=fake, ttl_seconds=3600, lease_secret=secret)) == grpc.StatusCode.PERMISSION_DENIED
    got = reg.stub.GetSegment(pb.GetSegmentRequest(name=wid), timeout=5).worker
    assert got.grpc_address == "127.0.0.1:1" and got.segment.incarnation == "inc-1"
    with pytest.raises(queue.Empty):
        _events_of(events, wid, 1, timeout=0.5)  # watchers saw nothing
    # the owner's own replacement works and keeps its secret
    again = _register(reg.stub, _record(wid, incarnation="inc-2"), secret=lease.lease_secret)
    assert again.lease_secret == lease.lease_secret and again.lease_id != lease.lease_id
    ev = _events_of(events, wid, 1)[0]
    assert ev.kind == _Ev.UPDATED and ev.worker.segment.incarnation == "inc-2"
    call.cancel()


def test_lease_expiry_then_a_new_owner_is_a_new_incarnation(reg):
    wid = _wid("d")
    call, events = _watch(reg.stub)
    old = _register(reg.stub, _record(wid), ttl=1)
    assert _events_of(events, wid, 1)[0].kind == _Ev.ADDED
    t0 = time.monotonic()
    ev = _events_of(events, wid, 1, timeout=8)[0]  # no heartbeats
    assert ev.kind == _Ev.REMOVED and ev.reason == "lease expired"
    assert 0.5 < time.monotonic() - t0 < 8
    assert _code(reg.stub.GetSegment, pb.GetSegmentRequest(name=wid)) == grpc.StatusCode.NOT_FOUND
    new = _register(reg.stub, _record(wid, incarnation="inc-2"))  # no secret needed now
    assert new.lease_secret != old.lease_secret
    ev = _events_of(events, wid, 1)[0]
    assert ev.kind == _Ev.ADDED and ev.worker.segment.incarnation == "inc-2"
    # the old owner can neither renew nor remove the new record
    assert _code(reg.stub.Heartbeat, pb.HeartbeatRequest(
        worker_id=wid, lease_id=new.lease_id, lease_secret=old.lease_secret)) == \
        grpc.StatusCode.PERMISSION_DENIED
    assert _code(reg.stub.Unregister, pb.UnregisterRequest(
        worker_id=wid, lease_secret=old.lease_secret)) == grpc.StatusCode.PERMISSION_DENIED
    call.cancel()


def test_watch_events_in_order(reg):
    p, d = _wid("p"), _wid("d")
    call, events = _watch(reg.stub)
    dcall, devents = _watch(reg.stub, pb.DECODE)
    _register(reg.stub, _record(p, pb.PREFILL))
    lease = _register(reg.stub, _record(d))
    _register(reg.stub, _record(d, incarnation="inc-2"), secret=lease.lease_secret)
    reg.stub.Unregister(pb.UnregisterRequest(worker_id=d, lease_secret=lease.lease_secret),
                        timeout=5)
    assert [e.kind for e in _events_of(events, p, 1)] == [_Ev.ADDED]
    evs = _events_of(events, d, 3)
    assert [e.kind for e in evs] == [_Ev.ADDED, _Ev.UPDATED, _Ev.REMOVED]
    assert [e.worker.segment.incarnation for e in evs] == ["inc-1", "inc-2", "inc-2"]
    assert evs[2].reason == "unregistered"
    assert [e.kind for e in _events_of(devents, d, 3)] == [_Ev.ADDED, _Ev.UPDATED, _Ev.REMOVED]
    with pytest.raises(queue.Empty):
        _events_of(devents, p, 1, timeout=0.3)  # role filter
    call.cancel()
    dcall.cancel()


def test_restarted_worker_waits_out_its_old_lease(reg):
    """A worker SIGKILLed and started again (same id, new incarnation): its old lease holds the id
    until it expires; then the new process registers, and watchers see REMOVED then ADDED."""
    wid = _wid("d")
    call, events = _watch(reg.stub)
    first = RegistryClient(reg.address, worker_id=wid, role="decode", ttl_s=1, watch=False)
    first.publish(_segment(wid, "inc-1"))
    first.close(unregister=False)  # as if killed: heartbeats stop, no Unregister
    second = RegistryClient(reg.address, worker_id=wid, role="decode", ttl_s=1, watch=False)
    try:
        second.publish(_segment(wid, "inc-2"))
        evs = _events_of(events, wid, 3)
        assert [(e.kind, e.worker.segment.incarnation) for e in evs] == [
            (_Ev.ADDED, "inc-1"), (_Ev.REMOVED, "inc-1"), (_Ev.ADDED, "inc-2")]
        time.sleep(1.5)  # > TTL: the new owner's heartbeats keep it
        got = reg.stub.GetSegment(pb.GetSegmentRequest(name=wid), timeout=5).worker
        assert got.segment.incarnation == "inc-2" and second.registrations == 1
    finally:
        second.close()
    assert _events_of(events, wid, 1)[0].reason == "unregistered"
    call.cancel()


def test_registry_restart(backend, request):
    """memory: the restarted registry is empty and the client registers again; etcd: the records
    are still there and the client's lease (and secret) still work, no re-registration."""
    etcd = request.getfixturevalue("etcd") if backend == "etcd" else None
    extra = _backend_args(backend, etcd, f"/hm-{uuid.uuid4().hex[:6]}/")
    port = _free_port()
    r = RegistryProc(port=port, ttl=2, extra=extra)
    wid = _wid("d")
    # a TTL longer than the registry's restart (a few seconds on a loaded box)
    client = RegistryClient(r.address, worker_id=wid, role="decode", ttl_s=8, watch=False)
    try:
        client.publish(_segment(wid))
        r.stop(signal.SIGKILL)
        r = RegistryProc(port=port, ttl=2, extra=extra)
        if backend == "etcd":  # at once, before any heartbeat could re-register (wait_for_ready:
            # this process's channels share one subchannel, still backing off from the old one)
            got = r.stub.GetSegment(pb.GetSegmentRequest(name=wid), timeout=10, wait_for_ready=True)
            assert got.worker.worker_id == wid
        deadline = time.monotonic() + 10
        while True:
            try:
                r.stub.GetSegment(pb.GetSegmentRequest(name=wid), timeout=5)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "worker did not come back"
                time.sleep(0.2)
        time.sleep(1.5)  # heartbeats go on against the new process
        assert client.registrations == (1 if backend == "etcd" else 2)
        assert client.lease_valid_for() > 0
        client.close()  # unregisters with its secret
        assert _code(r.stub.GetSegment, pb.GetSegmentRequest(name=wid)) == grpc.StatusCode.NOT_FOUND
    finally:
        client.close()
        r.stop()


def test_etcd_restart_keeps_serving(etcd):
    """etcd SIGKILLed under a running registry: calls fail UNAVAILABLE (the registry survives),
    and once etcd is back the record, its lease and the watch work again."""
    r = RegistryProc(ttl=2, extra=_backend_args("etcd", etcd, f"/hm-{uuid.uuid4().hex[:6]}/"))
    wid = _wid("d")
    try:
        lease = _register(r.stub, _record(wid), ttl=10)
        call, events = _watch(r.stub)
        assert _events_of(events, wid, 1)[0].kind == _Ev.ADDED  # snapshot
        etcd.stop(signal.SIGKILL)
        assert _code(r.stub.GetSegment, pb.GetSegmentRequest(name=wid)) == grpc.StatusCode.UNAVAILABLE
        etcd.start()
        hb = pb.HeartbeatRequest(worker_id=wid, lease_id=lease.lease_id,
                                 lease_secret=lease.lease_secret)
        assert r.stub.Heartbeat(hb, timeout=10).ttl_seconds > 0
        other = _wid("p")
        _register(r.stub, _record(other, pb.PREFILL))
        assert _events_of(events, other, 1, timeout=10)[0].kind == _Ev.ADDED  # watch resumed
        call.cancel()
        assert r.proc.poll() is None
    finally:
        r.stop()


@pytest.mark.parametrize("argv, message", [
    (["--etcd-endpoints", "127.0.0.1:1"], "--etcd-endpoints needs --registry-backend etcd"),
    (["--registry-backend", "etcd"], "needs --etcd-endpoints"),
    (["--registry-backend", "etcd", "--etcd-endpoints", "127.0.0.1:1"], "no etcd endpoint answers"),
])
def test_bad_backend_flags_exit_2(argv, message):
    p = subprocess.run([sys.executable, "-m", "halfmoon", "serve-transfer", "--port", "0",
                        "--metrics-port", "-1", *argv], capture_output=True, text=True, cwd=ROOT,
                       timeout=60, env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr
