"""The router end to end on 1 prefill + 1 decode (real processes from ``halfmoon up``'s launcher):
greedy tokens equal the co-located engine through gRPC and through OpenAI HTTP (real ``openai``
client, stream and not); 16 concurrent clients; cancel / disconnect / deadline / Router.Abort free
everything on P and D (KV accounting invariant); validation; cached tokens; router metrics."""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest

from protos import common_pb2, router_pb2
from tests.e2e.conftest import MAX_TOKENS, greedy, reference_ids, router_stub, stack_fixture, worker_targets
from tests.integration.conftest import MODEL, assert_idle_accounting

# Aborted requests ask for 300-400 tokens: tens of seconds of decoding on 2 CPU cores. Idle within
# this many seconds therefore shows the abort reached both legs (the request did not just finish).
ABORT_IDLE_S = 4.0
LONG_SYSTEM = ("You are a careful assistant for a small museum of maritime history. You answer questions about "
               "lighthouses, ships, harbours and the people who worked there, in plain words and short sentences. "
               "When you do not know, you say so. ") * 2


stack = stack_fixture(prefill=1, decode=1)


@pytest.fixture(scope="module")
def cases(tok):
    """(name, GenerateRequest input kwargs, prompt ids, reference output ids)."""
    text = "The lighthouse keeper climbed the stairs and"
    ids = tok.encode("Once upon a time, in a small village by the sea, there lived an old fisherman who "
                     "every morning mended his nets and told stories to the children of the harbour.")
    chat = [("system", LONG_SYSTEM), ("user", "Why did lighthouses need keepers?")]
    chat_ids = tok.encode_chat([{"role": r, "content": c} for r, c in chat])
    prompts = [tok.encode(text), ids, chat_ids]
    refs = reference_ids(prompts, MAX_TOKENS)
    msgs = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role=r, content=c) for r, c in chat])
    return [("text", {"text": text}, prompts[0], refs[0]),
            ("token_ids", {"token_ids": router_pb2.TokenIds(ids=ids)}, prompts[1], refs[1]),
            ("chat", {"chat": msgs}, prompts[2], refs[2])]


def _auth(stack) -> dict:
    """The stack's API key as the HTTP bearer header (`halfmoon up` makes one)."""
    return {"Authorization": f"Bearer {stack.endpoints['api_key']}"}


def collect(stub, timeout=120, **kw):
    resps = list(stub.Generate(router_pb2.GenerateRequest(**kw), timeout=timeout))
    return [t for r in resps for t in r.token_ids], "".join(r.text for r in resps), resps[-1]


def test_grpc_greedy_equals_colocated_engine(stub, cases, tok):
    for name, inp, prompt, ref in cases:
        ids, text, last = collect(stub, sampling=greedy(), **inp)
        assert ids == ref, name
        assert text == tok.hf.decode(ref, skip_special_tokens=True), name
        assert last.finish_reason in ("length", "stop")
        u = last.usage
        assert u.prompt_tokens == len(prompt) and u.completion_tokens == len(ref)
        assert 0 <= u.cached_tokens <= u.prompt_tokens
        assert last.prefill_worker == "prefill-0" and last.decode_worker == "decode-0"


def test_openai_http_equals_colocated_engine(client, cases, tok):
    _, text_in, _, ref = cases[0]
    want = tok.hf.decode(ref, skip_special_tokens=True)
    r = client.completions.create(model=MODEL, prompt=text_in["text"], max_tokens=MAX_TOKENS, temperature=0,
                                  logprobs=2, seed=7)
    assert r.choices[0].text == want and r.usage.completion_tokens == len(ref)
    assert len(r.choices[0].logprobs.token_logprobs) == len(ref)
    assert all(lp <= 0 for lp in r.choices[0].logprobs.token_logprobs)
    assert all(len(top) == 2 for top in r.choices[0].logprobs.top_logprobs)
    stream = client.completions.create(model=MODEL, prompt=text_in["text"], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == want

    _, _, _, chat_ref = cases[2]
    want = tok.hf.decode(chat_ref, skip_special_tokens=True)
    msgs = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Why did lighthouses need keepers?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=True, top_logprobs=1)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert len(r.choices[0].logprobs.content) == len(chat_ref)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    usage = chunks[-1].usage
    assert usage.completion_tokens == len(chat_ref) and usage.prompt_tokens == len(cases[2][2])
    # the same prompt again: the prefill radix cache serves (page-aligned part of) the prompt
    assert usage.prompt_tokens_details.cached_tokens >= 16


def test_stop_string_removed(client, cases, tok):
    _, inp, _, ref = cases[0]
    full = tok.hf.decode(ref, skip_special_tokens=True)
    word = full.split()[2]
    r = client.completions.create(model=MODEL, prompt=inp["text"], max_tokens=MAX_TOKENS, temperature=0, stop=[word])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(word)]


def test_sixteen_concurrent_clients(stub, cases):
    def one(i):
        name, inp, _, ref = cases[i % len(cases)]
        ids, _, last = collect(stub, sampling=greedy(), **inp)
        return ids == ref and last.finish_reason in ("length", "stop")

    with ThreadPoolExecutor(16) as ex:
        assert all(ex.map(one, range(16)))


def test_client_cancel_frees_both_legs(stack, stub, cases):
    _, inp, _, _ = cases[1]
    call = stub.Generate(router_pb2.GenerateRequest(sampling=greedy(400, ignore_eos=True), **inp), timeout=120)
    got = [next(call) for _ in range(2)]
    assert any(r.token_ids for r in got)
    call.cancel()
    assert_idle_accounting(worker_targets(stack), timeout=ABORT_IDLE_S, credentials=stack.credentials.client())


def test_router_abort_by_request_id(stack, stub, cases):
    _, inp, _, _ = cases[1]
    call = stub.Generate(router_pb2.GenerateRequest(request_id="abort-me", sampling=greedy(400, ignore_eos=True),
                                                    **inp), timeout=120)
    first = next(call)
    assert first.token_ids
    assert stub.Abort(common_pb2.AbortRequest(request_id="abort-me")).found
    rest = list(call)
    assert rest and rest[-1].finish_reason == "abort"
    assert rest[-1].usage.completion_tokens < 400
    assert not stub.Abort(common_pb2.AbortRequest(request_id="abort-me")).found
    assert_idle_accounting(worker_targets(stack), timeout=ABORT_IDLE_S, credentials=stack.credentials.client())


def test_http_disconnect_frees_both_legs(stack, cases):
    _, inp, _, _ = cases[0]
    url = f"http://{stack.endpoints['router']['http']}/v1/completions"
    body = {"model": MODEL, "prompt": inp["text"], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60, headers=_auth(stack)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    # closed mid-stream: the router aborts P and D
    assert_idle_accounting(worker_targets(stack), timeout=ABORT_IDLE_S, credentials=stack.credentials.client())


def test_http_non_stream_client_gone_frees_both_legs(stack, cases):
    _, inp, _, _ = cases[0]
    url = f"http://{stack.endpoints['router']['http']}/v1/completions"
    body = {"model": MODEL, "prompt": inp["text"], "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=body, timeout=httpx.Timeout(10, read=1.5), headers=_auth(stack))   # gives up, closes the connection
    assert_idle_accounting(worker_targets(stack), timeout=ABORT_IDLE_S, credentials=stack.credentials.client())


def test_deadline_aborts_both_legs(stack, stub, cases):
    _, inp, _, _ = cases[1]
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.Generate(router_pb2.GenerateRequest(sampling=greedy(300, ignore_eos=True), **inp), timeout=1.5))
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_idle_accounting(worker_targets(stack), timeout=ABORT_IDLE_S, credentials=stack.credentials.client())


def test_bad_input_is_invalid_argument_naming_the_field(stub, client):
    for kw, field in [({"text": ""}, "prompt"), ({"text": "hi", "model": "gpt-x"}, "model"),
                      ({"text": "hi", "sampling": greedy(9000)}, "max_tokens"),
                      ({"text": "hi", "sampling": common_pb2.SamplingParams(top_p=1.5)}, "top_p")]:
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(router_pb2.GenerateRequest(**kw), timeout=30))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.details().startswith(field)
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=9000)
    assert ei.value.status_code == 400 and ei.value.body["param"] == "max_tokens"
    # the stack still serves
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0).choices[0].text


def test_request_that_never_fits_the_kv_pool_is_a_400_without_retry(stack, stub, client):
    """prompt + max_tokens within the context window (8192) but above the decode pool (64 MiB ~ 1456
    tokens): RESOURCE_EXHAUSTED on gRPC, HTTP 400 context_length_exceeded (not a 429 that clients
    retry), one attempt only, nothing left held on the workers."""
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.Generate(router_pb2.GenerateRequest(text="Tell me a story.", sampling=greedy(4000)),
                           timeout=60))
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="Tell me a story.", max_tokens=4000)
    assert ei.value.body["code"] == "context_length_exceeded" and ei.value.body["param"] == "max_tokens"
    metrics = httpx.get(f"http://{stack.endpoints['router']['metrics']}/metrics").text
    retries = sum(float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("halfmoon_router_retries_total"))
    assert retries == 0
    assert_idle_accounting(worker_targets(stack), credentials=stack.credentials.client())
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0).choices[0].text


def test_health_and_reflection_served(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with router_stub(stack)[0] as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="halfmoon.v1.Router"))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(ch)
        assert "halfmoon.v1.Router" in db.get_services()
        assert db.FindFileContainingSymbol("halfmoon.v1.Router").name == "protos/router.proto"


def test_list_models_and_workers(stub, client):
    assert [m.id for m in stub.ListModels(router_pb2.ListModelsRequest()).models] == [MODEL]
    assert [m.id for m in client.models.list().data] == [MODEL]
    ws = stub.ListWorkers(router_pb2.ListWorkersRequest()).workers
    assert sorted((w.role, w.worker_id, w.healthy) for w in ws) == [("decode", "decode-0", True),
                                                                    ("prefill", "prefill-0", True)]


def test_router_metrics(stack):
    time.sleep(0.2)
    text = urllib.request.urlopen(f"http://{stack.endpoints['router']['metrics']}/metrics", timeout=10).read().decode()

    def value(prefix):
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(prefix) and not line.startswith("#"))

    assert value('halfmoon_router_requests_total{policy="cache_aware/cache_aware",status="ok",tenant="') >= 10
    assert value('halfmoon_router_requests_total{policy="cache_aware/cache_aware",status="cancelled",tenant="') >= 2
    assert value('halfmoon_router_requests_total{policy="cache_aware/cache_aware",status="invalid",tenant="') >= 4
    assert value("halfmoon_router_time_to_first_token_seconds_count") >= 10
    assert value("halfmoon_router_inter_token_latency_seconds_count") >= 10
    assert value("halfmoon_router_completion_tokens_total") >= 10 * MAX_TOKENS
    assert value("halfmoon_router_requests_in_flight") == 0
