"""1 prefill + 1 decode on the etcd registry backend (`halfmoon up --registry etcd`: a real etcd
from Debian's etcd-server on loopback, real workers, router and model): greedy tokens equal the
co-located engine; etcd SIGKILLed and restarted on its port and data dir while a request runs
(the request finishes, new ones are served, no stale worker is paired); a worker SIGKILLed: its
etcd lease expires and the router drops it within the lease TTL, and its restart under the same
id is paired as a new incarnation. KV accounting idle on every live worker at the end.

The tests run in file order on one stack (each builds on the previous one's state)."""

from __future__ import annotations

import re
import signal
import threading
import time

import grpc
import pytest

from halfmoon.etcd_local import etcd_binary
from halfmoon.child_process import Proc
from halfmoon.stack import _WORKER_RE
from protos import router_pb2
from tests.e2e.conftest import greedy, reference_ids, router_stub, running_stack
from tests.integration.conftest import assert_idle_accounting

LEASE_TTL_S = 6  # workers' --lease-ttl: heartbeats every 2 s, P's write fence at 2 s left
PROMPTS = ["The lighthouse keeper climbed the stairs and",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who"]
MAX_TOKENS = 8
LONG_TOKENS = 400  # the request that runs across the etcd outage (96 ended before etcd was back once B=1 decode took ~25 ms a token)
ETCD_DOWN_S = 2.5  # longer than a heartbeat interval (TTL / 3): at least one heartbeat fails


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if etcd_binary() is None:
        pytest.fail("etcd is not installed: run scripts/install-tools.sh")
    lease = ["--lease-ttl", str(LEASE_TTL_S)]
    with running_stack(tmp_path_factory.mktemp("e2e-etcd"), prefill=1, decode=1, registry="etcd",
                       role_args={"prefill": lease, "decode": lease}) as st:
        yield st


@pytest.fixture(scope="module")
def stub(stack):
    ch, s = router_stub(stack)
    yield s
    ch.close()


@pytest.fixture(scope="module")
def refs(tok):
    prompts = [tok.encode(p) for p in PROMPTS]
    return prompts, reference_ids(prompts, MAX_TOKENS)


def _generate(stub, ids, max_tokens=MAX_TOKENS, timeout=120, **kw):
    resps = list(stub.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                                          sampling=greedy(max_tokens, **kw)), timeout=timeout))
    return [t for r in resps for t in r.token_ids], resps[-1]


def _workers(stub) -> dict[str, router_pb2.WorkerStatus]:
    return {w.worker_id: w for w in stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers}


def _assert_served_by_reference(stub, refs, decode_worker="decode-0"):
    prompts, want = refs
    for ids, ref in zip(prompts, want):
        got, last = _generate(stub, ids)
        assert got == ref
        assert (last.prefill_worker, last.decode_worker) == ("prefill-0", decode_worker)


def test_greedy_equals_colocated_engine_on_etcd(stack, stub, refs):
    assert stack.etcd is not None and stack.etcd.proc.poll() is None
    _assert_served_by_reference(stub, refs)


def test_etcd_sigkill_and_restart_while_a_request_runs(stack, stub, refs):
    before = _workers(stub)
    assert set(before) == {"prefill-0", "decode-0"} and all(w.healthy for w in before.values())
    prompt = refs[0][0]
    out: dict = {}
    first_token = threading.Event()

    toks: list[int] = []

    def run():
        try:
            for r in stub.Generate(router_pb2.GenerateRequest(
                    token_ids=router_pb2.TokenIds(ids=prompt),
                    sampling=greedy(LONG_TOKENS, ignore_eos=True)), timeout=120):
                toks.extend(r.token_ids)
                first_token.set()
                last = r
            out["ids"], out["last"] = list(toks), last
        except grpc.RpcError as e:  # reported by the assertion below
            out["error"] = e
            first_token.set()

    t = threading.Thread(target=run)
    t.start()
    assert first_token.wait(60), "the long request produced no token"
    etcd_pid = stack.etcd.proc.pid
    stack.etcd.stop(signal.SIGKILL)
    at_kill = len(toks)
    time.sleep(ETCD_DOWN_S)
    stack.etcd.start()  # same client port, same data dir
    at_back = len(toks)
    assert stack.etcd.proc.pid != etcd_pid
    print(f"long request: {at_kill} tokens at the etcd SIGKILL, {at_back} when etcd was back")
    assert at_back < LONG_TOKENS, "the request ended before etcd was back: make it longer"
    t.join(120)
    assert "error" not in out, out.get("error")
    assert len(out["ids"]) == LONG_TOKENS and out["last"].finish_reason == "length"
    # the registry's etcd watch comes back (it re-reads the records and emits the difference)
    reg_log = stack.log_dir / "registry.log"
    deadline = time.monotonic() + 30
    while "etcd watch restored" not in reg_log.read_text():
        assert time.monotonic() < deadline, reg_log.read_text()[-3000:]
        time.sleep(0.2)
    # a heartbeat fell in the outage (relayed to etcd, refused); the next one after it renews the
    # lease kept in etcd's data dir, so P's lease fence has room again before new requests
    logs = "".join((stack.log_dir / f"{w}.log").read_text() for w in ("prefill-0", "decode-0"))
    assert "heartbeat failed: StatusCode.UNAVAILABLE" in logs
    time.sleep(LEASE_TTL_S / 3 + 0.5)
    # new requests are served by the same two workers (records and leases kept in etcd's data dir),
    # and nothing else is in the router's pool
    _assert_served_by_reference(stub, refs)
    after = _workers(stub)
    assert {k: (v.address, v.healthy) for k, v in after.items()} == {
        k: (v.address, True) for k, v in before.items()}


def test_worker_sigkill_lease_expires_within_ttl(stack, stub, refs):
    old = next(p for p in stack.procs if p.name == "decode-0")
    old_addr = _workers(stub)["decode-0"].address
    # the replacement starts loading at once; it may register decode-0 only once the old lease ended
    new = Proc("decode-0", list(old.argv), stack.log_dir / "decode-0.restarted.log", _WORKER_RE,
               extra_env=dict(old.extra_env))
    old.signal(signal.SIGKILL)
    old.popen.wait(10)
    killed = time.monotonic()
    stack.procs.append(new)
    new.start()
    # the router drops the dead incarnation when its etcd lease expires (no Unregister ran)
    # one snapshot per check: the lease can expire between two ListWorkers calls
    while (w := _workers(stub).get("decode-0")) is not None and w.address == old_addr:
        assert time.monotonic() - killed < LEASE_TTL_S + 2.0, "the dead decode-0 is still in the router's pool"
        time.sleep(0.1)
    gone_after = time.monotonic() - killed
    assert gone_after <= LEASE_TTL_S + 2.0
    reg_log = (stack.log_dir / "registry.log").read_text()
    assert re.search(r"lease of worker decode-0 expired", reg_log), reg_log[-3000:]
    deadline = time.monotonic() + 240
    while not new.poll_ready():
        assert new.alive(), new.tail()
        assert time.monotonic() < deadline, new.tail()
        time.sleep(0.2)
    new_addr = new.match.group(2)
    assert new_addr != old_addr
    deadline = time.monotonic() + 60
    while not ((w := _workers(stub).get("decode-0")) is not None and w.address == new_addr and w.healthy):
        assert time.monotonic() < deadline, _workers(stub)
        time.sleep(0.1)
    _assert_served_by_reference(stub, refs)
    assert [w.address for w in _workers(stub).values() if w.role == "decode"] == [new_addr]
    prefill_addr = _workers(stub)["prefill-0"].address
    assert_idle_accounting([("prefill", prefill_addr), ("decode", new_addr)],
                           credentials=stack.credentials.client())
    for name in ("registry", "router", "prefill-0", "decode-0.restarted"):
        text = (stack.log_dir / f"{name}.log").read_text()
        assert "Traceback" not in text and not re.search(r"\bERROR\b", text), (name, text[-3000:])
    print(f"lease expiry seen by the router {gone_after:.1f} s after SIGKILL (TTL {LEASE_TTL_S} s)")
