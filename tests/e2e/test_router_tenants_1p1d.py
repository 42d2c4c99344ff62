"""API keys and tenants on a real 1P1D stack (registry, prefill, decode, router with ``--api-key-file``)
with the real ``openai`` client: two tenants use one request id at the same time and both get the
greedy answer; one tenant's Abort of the other's running request finds nothing and that request runs
to its end; an unknown key is 401; the workers end idle with clean
accounting; no key appears in any process's log."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from protos import common_pb2, router_pb2, router_pb2_grpc
from tests.integration.conftest import (assert_clean_log, assert_idle_accounting, model_available,
                                        start_router, start_stack, wait_router_sees)

pytestmark = pytest.mark.skipif(not model_available(), reason="model not pulled (halfmoon models pull)")

KEYS = {"alice": "sk-alice-real-7c1e55aa", "bob": "sk-bob-real-19f0d3bb"}
PROMPT = "The capital of France is"


def test_two_tenants_on_real_workers(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()))
    key_file.chmod(0o600)
    with start_stack(tmp_path) as st:
        router = start_router(tmp_path, registry=st.registry.address, extra=["--api-key-file", str(key_file)])
        try:
            wait_router_sees(router, 2, api_key=KEYS["alice"])
            http = router.wait_line(r"READY router grpc=\S+ http=(\S+)").group(1)
            clients = {t: openai.OpenAI(base_url=f"http://{http}/v1", api_key=k, max_retries=0) for t, k in KEYS.items()}

            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"http://{http}/v1", api_key="sk-nobody", max_retries=0).completions.create(
                    model="", prompt=PROMPT, max_tokens=4)

            def complete(tenant):
                return clients[tenant].completions.create(model="", prompt=PROMPT, max_tokens=8, temperature=0,
                                                          extra_body={"request_id": "shared", "ignore_eos": True})

            with ThreadPoolExecutor(2) as ex:
                outs = list(ex.map(complete, ["alice", "bob"]))
            assert [o.id for o in outs] == ["shared", "shared"]
            assert [o.usage.completion_tokens for o in outs] == [8, 8] and outs[0].choices[0].text == outs[1].choices[0].text

            with grpc.insecure_channel(router.address) as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                md = {t: [("authorization", f"Bearer {k}")] for t, k in KEYS.items()}
                first, last = threading.Event(), []

                def run():
                    req = router_pb2.GenerateRequest(request_id="long", text=PROMPT, sampling=common_pb2.SamplingParams(
                        temperature=0, max_tokens=24, ignore_eos=True))
                    for resp in stub.Generate(req, metadata=md["alice"], timeout=120):
                        first.set()
                        last[:] = [resp]
                    first.set()

                t = threading.Thread(target=run)
                t.start()
                assert first.wait(120)
                found = stub.Abort(common_pb2.AbortRequest(request_id="long"), metadata=md["bob"]).found
                t.join(120)
            assert found is False
            assert last[0].finish_reason == "length" and last[0].usage.completion_tokens == 24
            assert_idle_accounting(st)
        finally:
            for c in locals().get("clients", {}).values():
                c.close()
            router.stop()
        logs = router.log() + "".join(p.log() for p in st.procs)
        for key in (*KEYS.values(), "sk-nobody"):
            assert key not in logs
        assert_clean_log(router)
