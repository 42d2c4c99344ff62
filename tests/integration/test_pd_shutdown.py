"""A worker stopped with SIGTERM while callers still wait on it answers them and exits.

Seen once during development: a prefill worker whose KV transfers were stuck (a broken transfer
engine) ignored SIGTERM forever, because Python joins the gRPC handler threads at exit and one was
blocked on a reply nobody would set. The schedulers' ``stop()`` now answers every unanswered caller
(UNAVAILABLE). This test covers the ordinary waiting states (P waiting for a destination, D waiting
for KV); the stuck-transfer state itself is not reproduced here.
"""

from __future__ import annotations

import secrets
import threading
import time

import grpc
import pytest

from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.integration.conftest import model_available, start_registry, start_worker

pytestmark = pytest.mark.skipif(not model_available(), reason="model not pulled (halfmoon models pull)")


def _call_in_thread(fn):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except grpc.RpcError as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_sigterm_answers_waiting_callers_and_exits(tmp_path):
    reg = start_registry(tmp_path)
    workers = []
    try:
        # a short drain: the waiting calls below outlast any grace (docs/architecture.md, Shutdown)
        p = start_worker("prefill", reg.address, tmp_path, "prefill-term", extra=["--drain-grace-s", "1"])
        d = start_worker("decode", reg.address, tmp_path, "decode-term", extra=["--drain-grace-s", "1"])
        workers += [p, d]
        sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=4)
        # P waits for a destination that never comes (no D leg for this room) ...
        pch = grpc.insecure_channel(p.address)
        pt, pout = _call_in_thread(lambda: prefill_pb2_grpc.PrefillStub(pch).Prefill(
            prefill_pb2.PrefillRequest(request_id="orphan-p", room=secrets.randbits(63) or 1,
                                       input_ids=[1, 2, 3, 4, 5], sampling=sampling), timeout=120))
        # ... and D waits for KV that never comes (P holds its destination, but no Prefill call).
        dch = grpc.insecure_channel(d.address)
        dt, dout = _call_in_thread(lambda: list(decode_pb2_grpc.DecodeStub(dch).Generate(
            decode_pb2.DecodeRequest(request_id="orphan-d", room=secrets.randbits(63) or 1,
                                     input_ids=[1, 2, 3, 4, 5], sampling=sampling,
                                     prefill_address=p.address, prefill_worker_id="prefill-term"),
            timeout=120)))
        time.sleep(2.0)  # both calls are now waiting inside the workers
        for w, t, out in [(d, dt, dout), (p, pt, pout)]:
            t0 = time.monotonic()
            w.popen.terminate()
            w.popen.wait(30)  # raises TimeoutExpired if the worker hangs on its waiting caller
            t.join(30)
            assert not t.is_alive()
            assert "error" in out, f"{w.name}: the waiting call got {out}"
            assert out["error"].code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), out
            assert time.monotonic() - t0 < 30
        pch.close()
        dch.close()
    finally:
        for w in workers:
            w.kill()
        reg.stop()
