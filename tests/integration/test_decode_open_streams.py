"""D's Generate streams take no server thread (``--stream-server aio``): a lone D with the smallest
pool of gRPC threads (8) serves 32 concurrent local-prefill streams while health checks and
GetLoad answer at once, and every stream gets its greedy tokens, the same as the request alone.

With the threaded servicer each open stream held one of the 8 threads until it ended, so the
other 24 streams, the health check and GetLoad waited behind them (the health check below timed
out). One D, no P (local prefill: D computes the prompt), one module, ~20 s."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.conftest import (assert_clean_log, assert_idle_accounting, model_available,
                                        start_registry, start_worker)
from tests.integration.pd_driver import sampling
from protos import common_pb2, decode_pb2, decode_pb2_grpc

pytestmark = pytest.mark.skipif(not model_available(), reason="SmolLM2 is not pulled (halfmoon models pull)")

# TOKENS: enough steps that the 32 streams are still open a second after they start (with the
# cpu_paged kernel 8 tokens each finished inside that second, and the test measured nothing)
N, TOKENS, PROMPTS = 32, 48, 4


@pytest.fixture(scope="module")
def lone_d(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("open-streams")
    reg = start_registry(log_dir)
    d = None
    try:
        d = start_worker("decode", reg.address, log_dir, "decode-0", extra=["--grpc-threads", "8"])
        yield d
    finally:
        for p in (d, reg):
            if p is not None:
                p.stop()


def _request(i: int) -> decode_pb2.DecodeRequest:
    return decode_pb2.DecodeRequest(request_id=f"r{i}", room=1000 + i, input_ids=[1, 504, 3458, 282, 30 + i % PROMPTS],
                                    sampling=sampling(TOKENS, ignore_eos=True), local_prefill=True)


async def _stream(stub, i: int) -> list[int]:
    toks = []
    async for c in stub.Generate(_request(i), timeout=120):
        toks += list(c.token_ids)
    return toks


def test_many_streams_leave_health_and_getload_served(lone_d):
    async def go():
        async with grpc.aio.insecure_channel(lone_d.address) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            alone = [await _stream(stub, i) for i in range(PROMPTS)]  # one per distinct prompt
            tasks = [asyncio.ensure_future(_stream(stub, i)) for i in range(N)]
            await asyncio.sleep(1.0)  # the streams are open on D
            t = time.monotonic()
            h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="halfmoon.v1.Decode"),
                                                           timeout=5)
            load = await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=5)
            answered = time.monotonic() - t
            busy = sum(not x.done() for x in tasks)
            return alone, await asyncio.gather(*tasks), h, load, answered, busy

    alone, got, h, load, answered, busy = asyncio.run(go())
    assert h.status == health_pb2.HealthCheckResponse.SERVING and answered < 5
    assert busy > 8  # more streams were open than D has gRPC threads
    assert load.running_requests + load.waiting_requests > 0
    for i, toks in enumerate(got):
        assert len(toks) == TOKENS and toks == alone[i % PROMPTS], i
    assert_idle_accounting([("decode", lone_d.address)])
    assert_clean_log(lone_d)
