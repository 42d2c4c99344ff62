"""Conditional disaggregation end to end on 1 prefill + 1 decode worker (real processes, registry
discovery, router ``--policy kv_events --local-prefill-max-tokens 40``): a 20-token follow-up turn and
a 30-token prompt D holds nothing of are served by D alone (no prefill leg: P's counters do not move)
and equal the transformers reference; prompts whose uncached tail is over the threshold (a new
conversation D holds nothing of, a long follow-up) still go through P;
every sampling field (seed, logprobs, logit_bias, stop, penalties, response_format) gives the same
output on the local path as on the PD path, through the real ``openai`` client; accounting is
clean afterwards."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from bench import prom_scrape
from protos import decode_pb2, decode_pb2_grpc, kv_events_pb2, kv_events_pb2_grpc, router_pb2
from router_svc.prefix_index import page_keys
from tests.e2e.conftest import greedy, running_stack, worker_targets
from tests.integration.conftest import assert_idle_accounting
from tests.integration.pd_driver import transformers_generate

PS = 16
# below the chat prompts of test_every_field_is_honoured_on_the_local_path (45-47 tokens), whose first
# request must go the PD way, and above a follow-up turn's tail (20 tokens + at most one page)
MAX_TAIL = 40
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("e2e-local-prefill"), prefill=1, decode=1, policy="kv_events",
                       router_args=["--local-prefill-max-tokens", str(MAX_TAIL)]) as st:
        yield st


def counters(stack) -> dict[str, float]:
    """The counters that say which worker computed what."""
    def total(url: str, name: str) -> float:
        return prom_scrape.metric_total({url: prom_scrape.scrape(f"http://{url}/metrics")}, name)

    p, d, r = stack.endpoints["prefill"][0]["metrics"], stack.endpoints["decode"][0]["metrics"], \
        stack.endpoints["router"]["metrics"]
    return {"p_prompt": total(p, "halfmoon_prefill_prompt_tokens_total"),
            "d_local": total(d, "halfmoon_decode_local_prefills_total"),
            "d_local_tokens": total(d, "halfmoon_decode_local_prefill_tokens_total"),
            "r_local": total(r, "halfmoon_router_local_prefills_total")}


def wait_decode_holds(stack, tokens: list[int], timeout: float = 20.0) -> None:
    """Until D's radix cache (a fresh KV-event snapshot) holds every full page of ``tokens``; the
    router's subscription to the same publisher then has them too (a moment later)."""
    keys = set(page_keys(tokens, PS))
    addr = stack.endpoints["decode"][0]["grpc"]
    deadline = time.monotonic() + timeout
    while True:
        with stack.credentials.client().channel(addr) as ch:
            call = kv_events_pb2_grpc.KVEventsStub(ch).Subscribe(kv_events_pb2.SubscribeKVEventsRequest(), timeout=10)
            snap = next(call)
            call.cancel()
        if keys <= {h for run in snap.runs for h in run.page_hashes}:
            time.sleep(0.5)
            return
        assert time.monotonic() < deadline, "D never reported the turn's pages"
        time.sleep(0.1)


def run(stub, ids, sampling=None):
    resps = list(stub.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                                          sampling=sampling or greedy(MAX_TOKENS)), timeout=120))
    return [t for r in resps for t in r.token_ids], resps[-1]


def conversation(tok) -> list[int]:
    text = "The lighthouse keeper kept a logbook. " + " ".join(f"Night {k}: the tide rose and the lamp held."
                                                               for k in range(12))
    return tok.encode(text)


def test_follow_up_turn_has_no_prefill_leg(stack, stub, tok):
    conv = conversation(tok)
    c0 = counters(stack)
    out1, last = run(stub, conv)
    # D holds nothing of a new conversation: the PD way
    assert last.prefill_worker == "prefill-0" and last.usage.kv_pages_transferred > 0
    c1 = counters(stack)
    assert c1["p_prompt"] - c0["p_prompt"] == len(conv) and c1["r_local"] == c0["r_local"]

    turn1 = conv + out1
    wait_decode_holds(stack, turn1[:-1])  # D caches the tokens whose K/V exist: all but the last one
    user = tok.encode(" Then the keeper wrote one more line about the storm that came at dawn, and then he slept until noon.")[:20]
    follow = turn1 + user
    assert len(user) == 20
    out2, last = run(stub, follow)
    c2 = counters(stack)
    assert last.prefill_worker == "" and last.decode_worker == "decode-0"
    assert c2["p_prompt"] == c1["p_prompt"], "a prefill leg ran"
    assert c2["r_local"] == c1["r_local"] + 1 and c2["d_local"] == c1["d_local"] + 1
    u = last.usage
    hit = (len(turn1) - 1) // PS * PS
    assert u.decode_prefix_tokens == hit and u.cached_tokens == hit  # D's hit; P computed nothing
    assert u.kv_pages_transferred == 0 and u.kv_bytes_transferred == 0
    assert c2["d_local_tokens"] - c1["d_local_tokens"] == len(follow) - hit

    # a tail over the threshold: P computes it again
    turn2 = follow + out2
    wait_decode_holds(stack, turn2[:-1])
    long_user = tok.encode(" ".join(f"Day {k}: the gulls circled the rocks below." for k in range(12)))
    assert len(long_user) > MAX_TAIL + PS
    out3, last = run(stub, turn2 + long_user)
    c3 = counters(stack)
    assert last.prefill_worker == "prefill-0" and c3["r_local"] == c2["r_local"]
    assert c3["p_prompt"] - c2["p_prompt"] == len(turn2 + long_user)
    assert last.usage.decode_prefix_tokens >= hit
    assert [out2, out3] == transformers_generate([follow, turn2 + long_user], MAX_TOKENS)


def test_short_fresh_prompt_has_no_prefill_leg(stack, stub, tok):
    # nothing of it is cached anywhere, but the whole prompt is under the threshold: D computes it
    prompt = tok.encode(" ".join(f"Buoy {k} blinked red over the harbour." for k in range(5)))[:30]
    assert len(prompt) == 30
    c0 = counters(stack)
    out, last = run(stub, prompt)
    c1 = counters(stack)
    assert last.prefill_worker == "" and last.decode_worker == "decode-0"
    assert c1["p_prompt"] == c0["p_prompt"], "a prefill leg ran"
    assert c1["r_local"] == c0["r_local"] + 1 and c1["d_local_tokens"] - c0["d_local_tokens"] == len(prompt)
    assert last.usage.kv_pages_transferred == 0 and last.usage.cached_tokens == 0
    assert [out] == transformers_generate([prompt], MAX_TOKENS)


def chat(client, messages, **kw):
    r = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, **kw)
    c = r.choices[0]
    lp = [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in c.logprobs.content] if c.logprobs else []
    return c.message.content, c.finish_reason, lp, r.usage


@pytest.mark.parametrize("name,kw", [
    ("sampled", dict(temperature=0.9, top_p=0.95, seed=7, max_tokens=12, logprobs=True, top_logprobs=3,
                     frequency_penalty=0.5, presence_penalty=0.3, logit_bias={"13": -100}, stop=["\n\n"])),
    ("json", dict(temperature=0.0, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "log", "schema": {
            "type": "object", "properties": {"night": {"type": "integer"}, "calm": {"type": "boolean"}},
            "required": ["night", "calm"], "additionalProperties": False}}})),
])
def test_every_field_is_honoured_on_the_local_path(stack, client, name, kw):
    # the name leads the prompt: no other test's pages match it, so the first request goes the PD way
    messages = [{"role": "system", "content": f"{name.upper()} logbook of the keeper."},
                {"role": "user", "content": "Write one entry for the night of the storm, when the lamp "
                                            "went out twice and the tide came over the pier."}]
    c0 = counters(stack)
    pd = chat(client, messages, **kw)
    c1 = counters(stack)
    assert c1["r_local"] == c0["r_local"] and c1["p_prompt"] - c0["p_prompt"] == pd[3].prompt_tokens
    # the same prompt again, once the router's index has D's pages of it (D's events): D alone
    for _ in range(40):
        before = counters(stack)
        local = chat(client, messages, **kw)
        after = counters(stack)
        if after["r_local"] > before["r_local"]:
            break
        time.sleep(0.25)
    else:
        pytest.fail("the repeated prompt never went to D alone")
    assert after["p_prompt"] == before["p_prompt"], "a prefill leg ran"
    assert local[:2] == pd[:2]
    assert [t for t, _, _ in local[2]] == [t for t, _, _ in pd[2]]
    assert [top for _, _, top in local[2]] == [top for _, _, top in pd[2]]
    assert local[2] == [] or max(abs(a[1] - b[1]) for a, b in zip(local[2], pd[2])) < 1e-3
    n = pd[3].prompt_tokens
    assert local[3].prompt_tokens == n and local[3].prompt_tokens_details.cached_tokens == (n - 1) // PS * PS
    if name == "json":
        entry = json.loads(local[0])
        assert set(entry) == {"night", "calm"} and local[1] == "stop"
    else:
        assert len(local[2]) == local[3].completion_tokens and all(len(t) == 3 for _, _, t in local[2])


def test_decode_refuses_a_prefill_address_with_local_prefill(stack):
    addr = stack.endpoints["decode"][0]["grpc"]
    with stack.credentials.client().channel(addr) as ch:
        req = decode_pb2.DecodeRequest(request_id="bad", room=5, input_ids=[1, 2, 3], sampling=greedy(2),
                                       local_prefill=True, prefill_address="127.0.0.1:1")
        with pytest.raises(grpc.RpcError) as e:
            list(decode_pb2_grpc.DecodeStub(ch).Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prefill_address" in e.value.details()


def test_accounting_is_clean(stack):
    assert_idle_accounting(worker_targets(stack), credentials=stack.credentials.client())
