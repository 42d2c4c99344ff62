"""Edges of the PD protocol on one real stack: bad input, requests that can never fit,
max_tokens=1, a first token that stops, stop strings spanning P's and D's tokens, logprobs, seeded
sampling continued on D, health / reflection / metrics. KV accounting is checked at the end."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.integration.conftest import assert_idle_accounting, model_available
from tests.integration.pd_driver import PDDriver, sampling
from protos import common_pb2, decode_pb2, prefill_pb2

pytestmark = pytest.mark.skipif(not model_available(), reason="SmolLM2 is not pulled (halfmoon models pull)")

TEXT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from engine.model_store import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m-instruct")))


@pytest.fixture(scope="module")
def drv(pd_stack):
    d = PDDriver(pd_stack.prefill_addr, pd_stack.decode_addr)
    yield d
    d.close()


@pytest.fixture(scope="module")
def ids(tok):
    return tok.encode(TEXT)


@pytest.fixture(scope="module")
def ref(drv, ids):
    r = drv.generate(ids, 8)
    assert r.ok and len(r.tokens) == 8, r
    return r.tokens


@pytest.mark.parametrize("room,input_ids,params,field", [
    (0, [1, 2], {}, "room"),
    (7, [], {}, "input_ids"),
    (7, [1, 10**6], {}, "input_ids"),
    (7, [1, 2], {"top_p": 1.5}, "top_p"),
    (7, [1, 2], {"max_tokens": 0}, "max_tokens"),
    (7, [1, 2], {"top_logprobs": 99}, "top_logprobs"),
    (7, [5] * 9000, {}, "input_ids"),      # longer than the model's context window
])
def test_bad_input_is_invalid_argument_naming_the_field(drv, room, input_ids, params, field):
    sp = common_pb2.SamplingParams(**params)
    with pytest.raises(grpc.RpcError) as e:
        drv.prefill.Prefill(prefill_pb2.PrefillRequest(room=room, input_ids=input_ids, sampling=sp), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field)
    with pytest.raises(grpc.RpcError) as e:
        list(drv.decode.Generate(decode_pb2.DecodeRequest(room=room, input_ids=input_ids, sampling=sp,
                                                          prefill_address=drv.prefill_addr), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field)


def test_never_fits_is_resource_exhausted(drv, pd_stack):
    total = next(iter(assert_idle_accounting(pd_stack).values())).total_pages
    too_long = [7] * (total * pd_stack.page_size + 1)   # more pages than either pool has
    with pytest.raises(grpc.RpcError) as e:
        drv.prefill.Prefill(prefill_pb2.PrefillRequest(room=9, input_ids=too_long, sampling=sampling(1)),
                            timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as e:   # D reserves prompt + max_tokens
        list(drv.decode.Generate(decode_pb2.DecodeRequest(room=9, input_ids=[7] * 100,
                                                          sampling=sampling(total * pd_stack.page_size),
                                                          prefill_address=drv.prefill_addr), timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_idle_accounting(pd_stack)


def test_max_tokens_one_is_the_prefill_token(drv, ids, ref):
    r = drv.generate(ids, 1)
    assert r.ok and r.tokens == ref[:1] and r.finish_reason == "length" and len(r.chunks) == 1, r
    assert r.prefill.first_token_id == ref[0]
    assert r.chunks[0].completion_tokens == 1 and r.chunks[0].prompt_tokens == len(ids)


def test_first_token_stop_id_finishes_at_once(drv, ids, ref):
    r = drv.generate(ids, params=sampling(8, stop_token_ids=[ref[0]]))
    assert r.ok and r.tokens == ref[:1] and r.finish_reason == "stop", r


def test_stop_string_spanning_prefill_and_decode_tokens(drv, tok, ids, ref):
    from engine.detokenizer import IncrementalDetokenizer

    det = IncrementalDetokenizer(tok, ids)
    t0 = det.add(ref[0]) + det.flush()
    det = IncrementalDetokenizer(tok, ids)
    t01 = "".join(det.add(t) for t in ref[:2]) + det.flush()
    assert t0 and len(t01) > len(t0)
    stop = t0[-1] + t01[len(t0)]          # last char of P's token + first char of D's first token
    assert stop not in t0
    r = drv.generate(ids, params=sampling(8, stop=[stop]))
    assert r.ok and r.finish_reason == "stop" and r.matched_stop == stop, r
    assert r.tokens == ref[:2], r


def test_logprobs_every_token(drv, ids, ref):
    r = drv.generate(ids, params=sampling(4, logprobs=True, top_logprobs=3))
    assert r.ok and r.tokens == ref[:4]
    assert [lp.token_id for lp in r.logprobs] == r.tokens
    for lp in r.logprobs:
        assert lp.logprob <= 0 and len(lp.top) == 3 and lp.top[0].token_id == lp.token_id  # greedy
        assert abs(lp.top[0].logprob - lp.logprob) < 1e-5


def test_seeded_sampling_continues_the_same_random_stream(drv, ids):
    """P samples token 0 with the request's generator and ships its state; D continues it, so the
    tokens equal a co-located run with the same seed."""
    import torch

    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    from engine.scheduler.request import Req
    from engine.sampler import make_generator
    from engine.sampling_params import SamplingParams
    from engine.scheduler.scheduler import Scheduler

    r = drv.generate(ids, params=sampling(8, temperature=1.3, seed=1234))
    assert r.ok, r
    torch.set_num_threads(1)
    cfg = EngineConfig(page_size=16, num_pages=64, torch_threads=1)
    runner = ModelRunner(cfg)
    sched = Scheduler(runner, cfg, set(runner.model_config.eos_token_ids))
    p = SamplingParams(max_tokens=8, temperature=1.3, seed=1234)
    req = Req("x", list(ids), p, make_generator(1234))
    sched.add(req)
    while sched.has_work():
        sched.step()
    assert r.tokens == req.output_ids


def test_health_reflection_metrics(pd_stack):
    for addr, svc in ((pd_stack.prefill_addr, "halfmoon.v1.Prefill"), (pd_stack.decode_addr, "halfmoon.v1.Decode")):
        with grpc.insecure_channel(addr) as ch:
            h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=svc), timeout=10)
            assert h.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=10))
            names = {s.name for s in resp.list_services_response.service}
            assert svc in names and "grpc.health.v1.Health" in names
    p = urllib.request.urlopen(f"http://{pd_stack.prefill.metrics_address}/metrics", timeout=10).read().decode()
    d = urllib.request.urlopen(f"http://{pd_stack.decode.metrics_address}/metrics", timeout=10).read().decode()

    def value(text, name):
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))

    assert value(p, "halfmoon_prefill_prompt_tokens_total") > 0
    assert value(p, "halfmoon_transfer_pages_total") > 0 and value(p, "halfmoon_transfer_bytes_total") > 0
    assert value(d, "halfmoon_decode_prompt_tokens_total") > 0
    assert value(d, "halfmoon_decode_generated_tokens_total") > 0
    assert 'halfmoon_worker_info{' in p and 'role="prefill"' in p and 'role="decode"' in d
    assert "halfmoon_decode_" not in p and "halfmoon_prefill_" not in d   # one owner per metric
    assert_idle_accounting(pd_stack)


def test_many_open_streams_leave_health_checks_and_requests_served(pd_stack, drv, ids, ref):
    """Every open server stream (Generate on D, Prefill on P, KVEvents subscriptions) holds one gRPC
    thread until it ends. With 64 threads (the old fixed pool) 100 open streams starved the health
    check, so the router marked a busy worker unhealthy (seen at 256 concurrent requests on the GPU)."""
    from protos import kv_events_pb2, kv_events_pb2_grpc

    channels, calls = [], []
    try:
        for addr in (pd_stack.prefill_addr, pd_stack.decode_addr):
            ch = grpc.insecure_channel(addr)
            channels.append(ch)
            stub = kv_events_pb2_grpc.KVEventsStub(ch)
            calls += [stub.Subscribe(kv_events_pb2.SubscribeKVEventsRequest(), timeout=60) for _ in range(100)]
        time.sleep(1.0)  # the streams reach the servers and take their threads
        for addr, svc in ((pd_stack.prefill_addr, "halfmoon.v1.Prefill"), (pd_stack.decode_addr, "halfmoon.v1.Decode")):
            with grpc.insecure_channel(addr) as ch:
                h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)
                assert h.status == health_pb2.HealthCheckResponse.SERVING
        r = drv.generate(ids, 8)
        assert r.ok and r.tokens == ref
        for call in calls:
            assert next(call).incarnation  # every stream is open: its snapshot came
    finally:
        for call in calls:
            call.cancel()
        for ch in channels:
            ch.close()
    assert_idle_accounting(pd_stack)
