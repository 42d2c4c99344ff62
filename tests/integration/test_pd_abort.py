"""Aborts, timeouts and worker deaths: every request ends with tokens or a clear status, survivors
keep serving, and the KV accounting holds (free + evictable + locked + owned = pool, no lock, room
or request slot left) on every live worker.

One stack with short timeouts (P waits 8 s for a destination, D waits 4 s for KV) and small prefill
chunks (so a long prompt takes several forwards); decode-1 runs one request at a time, so a second
request sits "transferred but not running". The kill tests start their own stacks.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from protos import prefill_pb2
from tests.integration.conftest import (assert_idle_accounting, get_load, model_available,
                                        start_stack, start_worker)
from tests.integration.pd_driver import PDDriver, sampling

pytestmark = pytest.mark.skipif(not model_available(), reason="SmolLM2 is not pulled (halfmoon models pull)")

LONG = [(i * 37) % 4000 + 100 for i in range(600)]


def prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 131 + i * 17) % 5000 + 200 for i in range(n)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with start_stack(tmp_path_factory.mktemp("abort"),
                     prefill_extra=["--destination-timeout", "8", "--chunked-prefill-size", "64"],
                     decode_extra=["--kv-wait-timeout", "4"],
                     more_decodes={"decode-1": ["--kv-wait-timeout", "4", "--max-running-requests", "1"]}) as st:
        yield st


def wait_until(pred, timeout=30.0, every=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every)
    return False


def test_abort_queued_and_prefilling(stack):
    drv = PDDriver(stack.prefill_addr, stack.decode_addr)
    a = drv.start(LONG, sampling(4))
    b = drv.start(prompt(1), sampling(4))  # queued behind A's chunks on P
    assert wait_until(lambda: get_load(stack.prefill_addr, "prefill").running_requests >= 1)
    # (P may not have B's request yet: its room is then tombstoned and the late Prefill refused)
    assert drv.abort(b.result.room, b.result.request_id)[1]
    assert drv.abort(a.result.room, a.result.request_id) == (True, True)   # mid-prefill on P
    for call in (a, b):
        r = call.wait()
        assert r.decode_error and r.decode_error[0] == "CANCELLED", r
        assert r.prefill_error and r.prefill_error[0] in ("CANCELLED", "ABORTED"), r
    assert drv.generate(prompt(2), 4).ok   # survivors keep serving
    assert_idle_accounting(stack)


def test_prefill_waiting_for_destination_abort_and_timeout(stack):
    drv = PDDriver(stack.prefill_addr, stack.decode_addr)
    # abort while P holds the computed KV and waits for D's destination
    c = drv.start(prompt(3), sampling(4), send_decode=False)
    time.sleep(1.5)
    assert drv.abort(c.result.room, decode=False)[0]
    r = c.wait()
    assert r.prefill_error[0] == "CANCELLED", r
    # no destination ever: the Prefill call's own deadline (8 s) bounds P's wait for one (a call
    # without a deadline gets --destination-timeout: tests/unit/test_prefill_scheduler.py)
    t0 = time.monotonic()
    r = PDDriver(stack.prefill_addr, stack.decode_addr, timeout_s=8).start(
        prompt(4), sampling(4), send_decode=False).wait()
    assert r.prefill_error[0] == "DEADLINE_EXCEEDED", r
    assert 7 < time.monotonic() - t0 < 30
    assert_idle_accounting(stack)


def test_decode_waiting_for_kv_abort_and_timeout(stack):
    drv = PDDriver(stack.prefill_addr, stack.decode_addr)
    # D pre-allocated and sent its destination; P never gets the request. Abort on D: D tells P,
    # P answers the buffered destination with ok=false, D's quarantined pages come back.
    c = drv.start(prompt(5), sampling(4), send_prefill=False)
    assert wait_until(lambda: get_load(stack.decode_addr, "decode").transferring_requests == 1)
    assert drv.abort(c.result.room, prefill=False)[1]
    r = c.wait()
    assert r.decode_error[0] == "CANCELLED", r
    # again without an abort: D's KV wait timeout (4 s)
    r = drv.start(prompt(6), sampling(4), send_prefill=False).wait()
    assert r.decode_error[0] == "DEADLINE_EXCEEDED", r
    assert_idle_accounting(stack)


def test_abort_transferred_but_not_running_and_decoding(stack):
    d1 = stack.decodes["decode-1"].address   # one running request at a time
    drv = PDDriver(stack.prefill_addr, d1)
    first = drv.start(prompt(7), sampling(400, ignore_eos=True))
    assert first.first_chunk(60)
    second = drv.start(prompt(8), sampling(8))
    # its KV is committed (first token streamed) but the running batch is full
    assert second.first_chunk(60)
    assert get_load(d1, "decode").running_requests == 2
    second.cancel()                           # client disconnect
    r2 = second.wait()
    assert r2.decode_error[0] == "CANCELLED" and len(r2.tokens) == 1, r2
    time.sleep(0.5)
    assert drv.abort(first.result.room, first.result.request_id, prefill=False)[1]   # decoding
    r1 = first.wait()
    assert r1.decode_error[0] == "CANCELLED" and 1 <= len(r1.tokens) < 400, r1
    assert drv.generate(prompt(9), 4).ok
    assert_idle_accounting(stack)


def test_many_aborts_at_random_stages(stack):
    """Cancel 12 concurrent requests at staggered times (queued, prefilling, transferring,
    decoding): each ends with tokens or CANCELLED, nothing leaks."""
    drv = PDDriver(stack.prefill_addr, stack.decode_addr)
    calls = [drv.start(prompt(20 + i, 40 + 50 * i), sampling(30)) for i in range(12)]
    for i, c in enumerate(calls):
        threading.Timer(0.2 * i, c.cancel).start()
    for c in calls:
        r = c.wait()
        assert r.ok or (r.decode_error and r.decode_error[0] in ("CANCELLED", "DEADLINE_EXCEEDED")), r
    assert drv.generate(prompt(40), 4).ok
    assert_idle_accounting(stack)


def _run_while(drv, n, max_tokens=24):
    results = []
    threads = []
    for i in range(n):
        t = threading.Thread(target=lambda i=i: results.append(
            drv.generate(prompt(100 + i, 300 + 40 * i), max_tokens)))
        t.start()
        threads.append(t)
    return results, threads


def test_prefill_killed_mid_transfer(tmp_path):
    """P is SIGKILLed mid-transfer. D learns P's worker id from the request (as from the router), so
    a room whose SetDestination P never answered is released on P's proven death, not at the fence
    deadline minutes later."""
    with start_stack(tmp_path) as st:
        drv = PDDriver(st.prefill_addr, st.decode_addr, timeout_s=60, prefill_worker_id="prefill-0")
        results, threads = _run_while(drv, 6)
        wait_until(lambda: get_load(st.prefill_addr, "prefill").running_requests
                   + get_load(st.prefill_addr, "prefill").transferring_requests >= 1, every=0.01)
        time.sleep(0.3)
        st.prefill.kill()
        for t in threads:
            t.join(90)
        assert len(results) == 6
        for r in results:
            assert r.ok or r.decode_error is not None, r   # tokens, or a clear status
            if not r.ok:
                assert r.decode_error[0] in ("UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED"), r
        assert any(not r.ok for r in results)
        # D survives: a new P serves through it, and D's pages all came back
        p2 = start_worker("prefill", st.registry.address, st.log_dir, "prefill-1")
        st.procs.append(p2)
        drv2 = PDDriver(p2.address, st.decode_addr, prefill_worker_id="prefill-1")
        assert drv2.generate(prompt(200), 4).ok
        assert_idle_accounting([("prefill", p2.address), ("decode", st.decode_addr)])


def test_prefill_stopped_then_killed_with_its_destination_unanswered(tmp_path):
    """D's SetDestination reaches a stopped P and times out: its outcome is unknown (P may have
    taken it), so the pages are quarantined. The worker id came with the request, so the destination
    was pinned to P's registered start; that start's death then frees the pages at once, not at the
    fence deadline (10 s RPC + 120 s window + 30 s margin). Before the pinning, a lost outcome left
    the room to the fence deadline."""
    with start_stack(tmp_path) as st:
        drv = PDDriver(st.prefill_addr, st.decode_addr, timeout_s=60, prefill_worker_id="prefill-0")
        with pytest.raises(grpc.RpcError) as e:   # only the start it is pinned to takes a destination
            drv.prefill.SetDestination(prefill_pb2.KVDestination(room=5, decode_segment="decode-0",
                                                                 prefill_incarnation="another-start"), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value
        assert e.value.details().startswith("prefill_incarnation:"), e.value.details()
        st.prefill.popen.send_signal(signal.SIGSTOP)
        try:
            r = drv.start(prompt(400, 200), sampling(4), send_prefill=False).wait()   # D's RPC deadline: 10 s
            assert r.decode_error[0] == "UNAVAILABLE" and "DEADLINE_EXCEEDED" in r.decode_error[1], r
            assert get_load(st.decode_addr, "decode").accounting.held_rooms == 1   # quarantined
        finally:
            st.prefill.kill()
        assert_idle_accounting([("decode", st.decode_addr)], timeout=15)
        assert "quarantined pages released (process_gone" in st.decode.log()
        drv.close()


def test_decode_killed_mid_transfer(tmp_path):
    with start_stack(tmp_path, prefill_extra=["--destination-timeout", "10"]) as st:
        drv = PDDriver(st.prefill_addr, st.decode_addr, timeout_s=60)
        results, threads = _run_while(drv, 6)
        wait_until(lambda: get_load(st.prefill_addr, "prefill").transferring_requests >= 1
                   or get_load(st.prefill_addr, "prefill").running_requests >= 2, every=0.01)
        st.decode.kill()
        for t in threads:
            t.join(90)
        assert len(results) == 6
        for r in results:
            assert r.ok or r.decode_error is not None, r
        # P survives: its sources were released; a new D serves with it
        d2 = start_worker("decode", st.registry.address, st.log_dir, "decode-1")
        st.procs.append(d2)
        drv2 = PDDriver(st.prefill_addr, d2.address)
        assert drv2.generate(prompt(300), 4).ok
        assert_idle_accounting([("prefill", st.prefill_addr), ("decode", d2.address)])
