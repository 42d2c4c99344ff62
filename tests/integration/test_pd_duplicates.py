"""Duplicate rooms and request ids on real processes: a call refused for a room another request
holds must leave that request alone (it completes with the reference tokens), an abort naming the
refused call's request id finds nothing, a room that ended is refused saying it ended, and the KV
accounting holds afterwards on both workers, which stay up.

The original request is held live on purpose: on D by a long decode, on P by sending its Prefill
alone (P then waits for D's destination) until the duplicate was refused.
"""

from __future__ import annotations

import secrets
import time

import grpc
import pytest

from protos import prefill_pb2
from tests.integration.conftest import assert_idle_accounting, get_load, model_available, start_stack
from tests.integration.pd_driver import PDDriver, sampling
from tests.integration.test_pd_abort import wait_until

pytestmark = pytest.mark.skipif(not model_available(), reason="SmolLM2 is not pulled (halfmoon models pull)")

PROMPT = [(i * 53) % 4000 + 300 for i in range(70)]
LONG = sampling(160, ignore_eos=True)   # keeps the original decoding while the duplicate comes


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with start_stack(tmp_path_factory.mktemp("dupes"), decode_extra=["--kv-wait-timeout", "15"]) as st:
        yield st


@pytest.fixture(scope="module")
def drv(stack):
    d = PDDriver(stack.prefill_addr, stack.decode_addr)
    yield d
    d.close()


@pytest.fixture(scope="module")
def ref(drv):
    r = drv.generate(PROMPT, params=LONG)
    assert r.ok and len(r.tokens) == 160, r
    return r.tokens


def assert_healthy(stack, drv, ref):
    assert stack.prefill.popen.poll() is None and stack.decode.popen.poll() is None
    assert_idle_accounting(stack)
    assert drv.generate(PROMPT, params=LONG).tokens == ref   # both still serve


def test_full_duplicate_leaves_the_original_running(stack, drv, ref):
    orig = drv.start(PROMPT, LONG)
    assert orig.first_chunk(60)
    # both legs, one after the other (the driver would cancel D's once P's failed)
    dup = drv.start(PROMPT, LONG, room=orig.result.room, request_id="dup-full", send_prefill=False).wait()
    assert dup.decode_error[0] == "ALREADY_EXISTS", dup
    dup = drv.start(PROMPT, LONG, room=orig.result.room, request_id="dup-full", send_decode=False).wait()
    assert dup.prefill_error is not None, dup   # P's leg of the original is over: its room ended
    assert drv.abort(0, "dup-full") == (False, False)   # the refused id names nothing
    r = orig.wait()
    assert r.ok and r.tokens == ref, r
    assert_healthy(stack, drv, ref)


def test_decode_only_duplicate_and_abort_by_its_request_id(stack, drv, ref):
    orig = drv.start(PROMPT, LONG)
    assert orig.first_chunk(60)
    dup = drv.start(PROMPT, LONG, room=orig.result.room, send_prefill=False).wait()
    assert dup.decode_error[0] == "ALREADY_EXISTS" and "in use" in dup.decode_error[1], dup
    assert drv.abort(0, dup.request_id) == (False, False)
    r = orig.wait()
    assert r.ok and r.tokens == ref, r
    assert_healthy(stack, drv, ref)


def test_prefill_only_duplicate_and_abort_by_its_request_id(stack, drv, ref):
    room, rid = secrets.randbits(63) or 1, "original-p"
    p_orig = drv.start(PROMPT, LONG, room=room, request_id=rid, send_decode=False)
    assert wait_until(lambda: get_load(stack.prefill_addr, "prefill").running_requests == 1)
    dup = drv.start(PROMPT, LONG, room=room, send_decode=False).wait()
    assert dup.prefill_error[0] == "ALREADY_EXISTS" and "already in use" in dup.prefill_error[1], dup
    assert drv.abort(0, dup.request_id) == (False, False)
    time.sleep(0.3)   # an abort would have reached P's scheduler by now
    d_orig = drv.start(PROMPT, LONG, room=room, request_id=rid, send_prefill=False)
    r = d_orig.wait()
    assert r.ok and r.tokens == ref, r
    assert p_orig.wait().prefill is not None, p_orig.result
    assert_healthy(stack, drv, ref)


def test_one_request_id_in_two_rooms_abort_by_id_ends_both(stack, drv, ref):
    """A request id may name several live rooms (the router retries with the same id and a new
    room): an abort by request id alone ends every one of them."""
    a = drv.start(PROMPT, LONG, request_id="twice", send_prefill=False)
    b = drv.start(PROMPT, LONG, request_id="twice", send_prefill=False)
    assert wait_until(lambda: get_load(stack.decode_addr, "decode").transferring_requests == 2)
    assert drv.abort(0, "twice", prefill=False) == (False, True)
    for call in (a, b):
        r = call.wait()
        assert r.decode_error and r.decode_error[0] == "CANCELLED", r
    assert_healthy(stack, drv, ref)


def test_a_completed_room_is_refused_as_ended_not_aborted(stack, drv, ref):
    done = drv.generate(PROMPT, params=LONG)
    assert done.ok and done.tokens == ref, done
    room = done.room
    late = drv.start(PROMPT, LONG, room=room, send_decode=False).wait()
    assert late.prefill_error == ("FAILED_PRECONDITION",
                                  f"room {room} has ended (a room is used by one request only)"), late
    with pytest.raises(grpc.RpcError) as e:   # a late destination for it is never taken
        drv.prefill.SetDestination(prefill_pb2.KVDestination(room=room, decode_segment="decode-0"), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "has ended" in e.value.details()
    # an aborted room still says so
    aborted = secrets.randbits(63) or 1
    drv.abort(aborted, prefill=True, decode=False)
    late = drv.start(PROMPT, LONG, room=aborted, send_decode=False).wait()
    assert late.prefill_error == ("ABORTED", f"room {aborted} was aborted"), late
    assert_healthy(stack, drv, ref)
