"""A client deadline that expires while the request's legs complete (a real router process, stub
workers in the test process): the client gets DEADLINE_EXCEEDED, or OK when the stream finished
first, and the router logs nothing at ERROR (no "Task exception was never retrieved" traceback for
a decode read that failed with the same deadline while the handler was being cancelled)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos import router_pb2, router_pb2_grpc
from tests.e2e.stub_workers import stub_workers
from tests.integration.conftest import assert_clean_log, model_available, start_router, wait_router_sees

pytestmark = pytest.mark.skipif(not model_available(), reason="model not pulled (halfmoon models pull)")

GAP_S = 0.1            # D's first token -> its last chunk
ROUNDS, PER_ROUND = 3, 120
CONCURRENCY = 8        # a busy router loop sees D's deadline status and the handler's cancel together


def test_deadline_at_completion_is_deadline_exceeded_without_error_log(tmp_path):
    with stub_workers(GAP_S) as (paddr, daddr):
        router = start_router(tmp_path, prefill=[paddr], decode=[daddr])
        try:
            wait_router_sees(router, 2)
            with grpc.insecure_channel(router.address) as ch:
                stub = router_pb2_grpc.RouterStub(ch)

                def generate(timeout: float) -> grpc.StatusCode:
                    try:
                        list(stub.Generate(router_pb2.GenerateRequest(text="Hello"), timeout=timeout))
                        return grpc.StatusCode.OK
                    except grpc.RpcError as exc:
                        return exc.code()

                t0 = time.monotonic()
                assert generate(30) == grpc.StatusCode.OK
                full = time.monotonic() - t0
                # deadlines from just before D's first token to just after its last chunk
                deadlines = [full - GAP_S + (GAP_S + 0.02) * i / PER_ROUND for i in range(PER_ROUND)] * ROUNDS
                with ThreadPoolExecutor(CONCURRENCY) as ex:
                    codes = list(ex.map(generate, deadlines))
                assert generate(30) == grpc.StatusCode.OK
            time.sleep(0.5)  # a task's unretrieved exception is logged when the task is collected
        finally:
            router.stop()
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}, codes
    assert grpc.StatusCode.OK in codes and grpc.StatusCode.DEADLINE_EXCEEDED in codes, "sweep missed completion"
    assert_clean_log(router)
