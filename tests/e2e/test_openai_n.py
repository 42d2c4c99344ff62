"""``n`` > 1, ``best_of`` and ``echo`` end to end on 1 prefill + 1 decode through the router (real
processes, real ``openai`` client, gRPC ``GenerateRequest.n``): greedy samples are identical, seeded
sample i equals an n=1 request with seed + i, streamed equals non-streamed, usage counts the prompt
once, the n samples are one prefill whose pages move to D once, aborting one sample leaves the others,
aborting the request ends all, and the KV accounting is idle after. One stack for the module."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, router_pb2
from tests.e2e.conftest import stack_fixture, worker_targets
from tests.integration.conftest import MODEL, assert_idle_accounting

stack = stack_fixture(prefill=1, decode=1)

PROMPT = "The old clockmaker opened his shop at dawn and"
CHAT = [{"role": "user", "content": "Name a colour and say why you like it."}]
SEED = 1234


TOKENS = 8


def _one(client, **kw):
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, **kw).choices[0]


def _streamed(chunks, chat: bool) -> tuple[dict[int, str], dict[int, str], list]:
    """(text by index, finish_reason by index, usage chunks) of a streamed answer."""
    text, finish, usages = {}, {}, []
    for ch in chunks:
        if ch.usage is not None:
            usages.append(ch.usage)
        for c in ch.choices:
            part = (c.delta.content if chat else c.text) or ""
            text[c.index] = text.get(c.index, "") + part
            if c.finish_reason:
                assert c.index not in finish, f"choice {c.index} finished twice"
                finish[c.index] = c.finish_reason
    return text, finish, usages


def test_greedy_n3_completions_are_identical_and_usage_counts_the_prompt_once(client):
    single = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=TOKENS)
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=TOKENS, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [single.choices[0].text] * 3
    assert [c.finish_reason for c in r.choices] == [single.choices[0].finish_reason] * 3
    assert r.usage.prompt_tokens == single.usage.prompt_tokens
    assert r.usage.completion_tokens == 3 * single.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_seeded_n3_sample_i_is_the_n1_request_with_seed_plus_i(client):
    kw = dict(temperature=1.0, top_p=0.95)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, n=3, seed=SEED, **kw)
    texts = [c.text for c in r.choices]
    # reproducible: each equals a request of its own, run later with the derived seed
    assert texts == [_one(client, seed=SEED + i, **kw).text for i in range(3)]
    assert len(set(texts)) > 1, texts          # distinct samples


def test_seeded_n3_chat_streamed_equals_non_streamed(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=TOKENS, n=3, seed=SEED, temperature=0.9)
    whole = client.chat.completions.create(**kw)
    text, finish, usages = _streamed(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw), chat=True)
    assert text == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert len(set(text.values())) > 1, text
    assert len(usages) == 1 and usages[0].completion_tokens == whole.usage.completion_tokens
    assert usages[0].prompt_tokens == whole.usage.prompt_tokens


def test_greedy_n3_completions_streamed(client):
    single = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=TOKENS)
    text, finish, usages = _streamed(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=TOKENS, n=3, temperature=0, stream=True,
        stream_options={"include_usage": True}), chat=False)
    assert text == {i: single.choices[0].text for i in range(3)}
    assert finish == {i: single.choices[0].finish_reason for i in range(3)}
    assert len(usages) == 1 and usages[0].completion_tokens == 3 * single.usage.completion_tokens


def test_n2_with_json_object_and_logit_bias(client, tok):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A JSON object, please."}],
                                       max_tokens=60, n=2, seed=SEED, temperature=0.8,
                                       response_format={"type": "json_object"})
    for c in r.choices:
        assert c.finish_reason == "stop", c
        assert isinstance(json.loads(c.message.content), dict)
    forced = tok.encode(" banana")[-1]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=2, temperature=0.7, seed=SEED,
                                  logit_bias={str(forced): 100})
    assert [c.text for c in r.choices] == [" banana" * 3] * 2


def test_best_of_returns_the_samples_with_the_highest_cumulative_logprob(client):
    kw = dict(temperature=1.0, max_tokens=6)
    singles = [client.completions.create(model=MODEL, prompt=PROMPT, seed=SEED + i, logprobs=0, **kw).choices[0]
               for i in range(3)]
    scores = [sum(c.logprobs.token_logprobs) for c in singles]
    order = sorted(range(3), key=lambda i: (-scores[i], i))
    r = client.completions.create(model=MODEL, prompt=PROMPT, seed=SEED, n=2, best_of=3, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [singles[i].text for i in order[:2]]
    assert all(c.logprobs is None for c in r.choices)   # not asked for: dropped
    with_lp = client.completions.create(model=MODEL, prompt=PROMPT, seed=SEED, n=1, best_of=3, logprobs=0, **kw)
    assert with_lp.choices[0].text == singles[order[0]].text
    assert sum(with_lp.choices[0].logprobs.token_logprobs) == pytest.approx(scores[order[0]], abs=1e-4)


def test_echo_puts_the_prompt_before_each_choice(client):
    single = _one(client, temperature=0)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0, n=2, echo=True)
    assert [c.text for c in r.choices] == [PROMPT + single.text] * 2
    text, _, _ = _streamed(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                                     echo=True, stream=True), chat=False)
    assert text == {0: PROMPT + single.text}


def _grpc(stub, n: int, rid: str = "", text: str = PROMPT, **sampling):
    req = router_pb2.GenerateRequest(request_id=rid, text=text, n=n,
                                     sampling=common_pb2.SamplingParams(temperature=0, **sampling))
    by: dict[int, list] = {}
    for resp in stub.Generate(req, timeout=120):
        by.setdefault(resp.index, []).append(resp)
    return by


def _counter(stack, role: str, name: str) -> float:
    """Sum of a counter on every worker of ``role`` (its /metrics)."""
    total = 0.0
    for w in stack.endpoints[role]:
        text = urllib.request.urlopen(f"http://{w['metrics']}/metrics", timeout=10).read().decode()
        total += sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))
    return total


def test_grpc_n3_is_one_prefill_and_the_prompt_pages_move_once(stub, stack):
    # a fresh prompt of 3 full pages + a partial one (page_size 16): P prefills it once and samples
    # 3 first tokens, the 4 pages move to D once, and D's samples 1, 2 share the full pages (their
    # decode prefix) with a copy of the partial one (a fixed text, used by no other test of the module)
    prompt = "Request grpc-n3, three samples: " + "the quick brown fox jumps over the lazy dog " * 5
    before = {(r, m): _counter(stack, r, m) for r, m in _ONE_PREFILL}
    by = _grpc(stub, 3, rid="grpc-n3", text=prompt, max_tokens=6)
    assert sorted(by) == [0, 1, 2]
    ids = [[t for r in by[i] for t in r.token_ids] for i in range(3)]
    assert ids[0] == ids[1] == ids[2] and len(ids[0]) == 6
    usage = [by[i][-1].usage for i in range(3)]
    assert all(r.request_id == "grpc-n3" for i in by for r in by[i])
    n = usage[0].prompt_tokens
    assert n % 16 and n > 48, "the prompt must end in a partial page"
    for (role, metric), was in before.items():   # exactly one prefill, one pre-allocation
        assert _counter(stack, role, metric) - was == n, (role, metric)
    assert [u.cached_tokens for u in usage] == [0, 0, 0]                  # P computed it, once
    assert [u.kv_pages_transferred for u in usage] == [-(-n // 16), 0, 0]  # the prompt's pages, once
    assert [u.decode_prefix_tokens for u in usage] == [0, n // 16 * 16, n // 16 * 16]  # shared on D
    assert_idle_accounting(worker_targets(stack), credentials=stack.credentials.client())


_ONE_PREFILL = (("prefill", "halfmoon_prefill_prompt_tokens_total"), ("decode", "halfmoon_decode_prompt_tokens_total"))


class _AbortWhenRunning(threading.Thread):
    """Router.Abort(rid) as soon as the router runs it (a sample's id exists once it started)."""

    def __init__(self, stub, rid: str) -> None:
        super().__init__()
        self.stub, self.rid, self.found = stub, rid, False
        self.start()

    def run(self) -> None:
        deadline = time.monotonic() + 30
        while not self.found and time.monotonic() < deadline:
            time.sleep(0.1)
            try:
                self.found = self.stub.Abort(common_pb2.AbortRequest(request_id=self.rid), timeout=10).found
            except (grpc.RpcError, ValueError):   # the test failed and closed the channel: stop
                return


def test_abort_of_one_sample_leaves_the_others_and_abort_of_the_request_ends_all(stub, stack):
    long = dict(max_tokens=64, ignore_eos=True)
    t = _AbortWhenRunning(stub, "n3-one#1")
    with ThreadPoolExecutor(1) as ex:   # the n=1 reference runs in the same decode batches
        reference = ex.submit(_grpc, stub, 1, **long)
        by = _grpc(stub, 3, rid="n3-one", **long)
        greedy = [t for r in reference.result()[0] for t in r.token_ids]
    t.join()
    assert t.found
    assert by[1][-1].finish_reason == "abort"
    for i in (0, 2):   # the shared prompt pages stayed under the other two
        assert by[i][-1].finish_reason == "length"
        assert [tok for r in by[i] for tok in r.token_ids] == greedy
    t = _AbortWhenRunning(stub, "n3-all")
    by = _grpc(stub, 3, rid="n3-all", **long)
    t.join()
    assert t.found
    assert [by[i][-1].finish_reason for i in range(3)] == ["abort"] * 3
    assert_idle_accounting(worker_targets(stack), credentials=stack.credentials.client())


def test_client_cancel_of_a_stream_aborts_every_sample(client, stack):
    chunks = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=300, n=3, seed=SEED,
                                            temperature=0.9, stream=True, extra_body={"ignore_eos": True})
    seen = set()
    for ch in chunks:
        seen |= {c.index for c in ch.choices if c.delta.content}
        if seen == {0, 1, 2}:
            break
    chunks.close()
    assert seen == {0, 1, 2}
    assert_idle_accounting(worker_targets(stack), credentials=stack.credentials.client())


def test_bad_sample_counts_are_400_naming_them(client):
    for kw, param in (({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": 3, "best_of": 2}, "best_of"),
                      ({"best_of": 2, "stream": True}, "best_of"), ({"echo": True, "logprobs": 1}, "echo")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)


def test_workers_refuse_bad_sample_counts_naming_n(stack, tok):
    """P and D check ``n`` before anything is allocated: above the bound, and n > 1 on D without a
    prefill leg (local_prefill samples one first token)."""
    ids = tok.encode(PROMPT)
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=2)
    targets = dict(worker_targets(stack))
    creds = stack.credentials.client()
    with creds.channel(targets["prefill"]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_pb2.PrefillRequest(
                request_id="bad-n", room=7, input_ids=ids, sampling=sampling, n=17), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("n:")
    with creds.channel(targets["decode"]) as ch:
        for n, local in ((17, False), (2, True)):
            req = decode_pb2.DecodeRequest(request_id="bad-n", room=8, input_ids=ids, sampling=sampling, n=n,
                                           local_prefill=local, prefill_address="" if local else "127.0.0.1:1")
            with pytest.raises(grpc.RpcError) as e:
                list(decode_pb2_grpc.DecodeStub(ch).Generate(req, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("n:"), n
    assert_idle_accounting(worker_targets(stack), credentials=creds)
