"""D's keepalive before the first token, against a real router process with stub workers in the
test process (tests/e2e/stub_workers.py): with ``--first-token-timeout 2``, a D that holds the first
token back for 5 s but sends an empty chunk every 0.5 s meanwhile (a request queued in D) succeeds,
through the real ``openai`` client and over gRPC; a D silent for those 5 s fails the attempt after
~2 s; an empty chunk after the first token never reaches a client as an empty response."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from protos import common_pb2, router_pb2, router_pb2_grpc
from tests.e2e.stub_workers import TOKENS, stub_workers
from tests.integration.conftest import assert_clean_log, model_available, start_router, wait_router_sees

pytestmark = pytest.mark.skipif(not model_available(), reason="model not pulled (halfmoon models pull)")

FIRST_TOKEN_TIMEOUT = 2.0
HOLD_S = 5.0        # stub D: call -> first token (> the timeout)
KEEPALIVE_S = 0.5


def test_keepalive_resets_first_token_timeout_silence_still_fails(tmp_path):
    with stub_workers(0.1, first_delay_s=HOLD_S, keepalive_s=KEEPALIVE_S) as (paddr, daddr):
        router = start_router(tmp_path, prefill=[paddr], decode=[daddr],
                              extra=["--first-token-timeout", str(FIRST_TOKEN_TIMEOUT), "--max-attempts", "1"])
        try:
            wait_router_sees(router, 2)
            http = router.wait_line(r"READY router grpc=\S+ http=(\S+)").group(1)
            client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="x", max_retries=0, timeout=30)
            with grpc.insecure_channel(router.address) as ch:
                stub = router_pb2_grpc.RouterStub(ch)

                def grpc_call(request_id: str):
                    t0 = time.monotonic()
                    try:
                        resps = list(stub.Generate(router_pb2.GenerateRequest(
                            request_id=request_id, text="Hello",
                            sampling=common_pb2.SamplingParams(max_tokens=3)), timeout=30))
                        return grpc.StatusCode.OK, "", resps, time.monotonic() - t0
                    except grpc.RpcError as exc:
                        return exc.code(), exc.details(), [], time.monotonic() - t0

                def openai_call():
                    t0 = time.monotonic()
                    chunks = list(client.completions.create(model="", prompt="Hello", max_tokens=3, stream=True))
                    return chunks, time.monotonic() - t0

                with ThreadPoolExecutor(3) as ex:
                    kept = ex.submit(grpc_call, "kept-1")
                    silent = ex.submit(grpc_call, "silent-1")
                    via_openai = ex.submit(openai_call)
                    kept, silent, (chunks, openai_s) = kept.result(), silent.result(), via_openai.result()
        finally:
            router.stop()

    code, detail, resps, kept_s = kept
    assert code == grpc.StatusCode.OK, detail
    assert kept_s >= HOLD_S
    assert [t for r in resps for t in r.token_ids] == TOKENS
    assert all(r.token_ids or r.finish_reason for r in resps), resps  # the empty chunk was not relayed
    assert resps[-1].finish_reason == "length"

    assert openai_s >= HOLD_S
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].text or c.choices[0].finish_reason for c in chunks), chunks

    code, detail, _, silent_s = silent
    assert code == grpc.StatusCode.UNAVAILABLE, (code, detail)
    assert f"no first token and no keepalive within {FIRST_TOKEN_TIMEOUT:g} s" in detail
    assert FIRST_TOKEN_TIMEOUT - 0.2 <= silent_s < HOLD_S - 0.5, silent_s
    assert_clean_log(router)
