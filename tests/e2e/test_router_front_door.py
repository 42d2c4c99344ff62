"""The router's front door (API keys, tenants, limits) on real router processes against stub workers
in the test process (tests/e2e/stub_workers.py; the workers are not what is tested here): unknown
and missing keys get 401 / UNAUTHENTICATED (the real ``openai`` client, raw HTTP, gRPC), good keys
work, ``/health`` and ``/metrics`` stay open, a tenant cannot abort or squat another tenant's request
id, oversize bodies get 413 / RESOURCE_EXHAUSTED, the rate limit and the admission queue answer 429
with ``Retry-After`` / RESOURCE_EXHAUSTED, and no key reaches a log or the metrics.

Two routers, module-scoped: ``door`` (keys, size limit) and ``limited`` (rate limit, admission
queue of 2, a decode stub that holds the first token). The open router is what every other router
test runs; a bad key file is tests/unit/test_router_front_door.py."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import common_pb2, router_pb2, router_pb2_grpc
from tests.e2e.stub_workers import stub_workers
from tests.integration.conftest import assert_clean_log, model_available, start_router, wait_router_sees

pytestmark = pytest.mark.skipif(not model_available(), reason="model not pulled (halfmoon models pull)")

KEYS = {"alice": "sk-alice-0a1b2c3d4e5f6a7b", "bob": "sk-bob-9f8e7d6c5b4a3f2e"}
DEFAULT_KEY = "sk-default-1234567890abcdef"
WRONG_KEY = "sk-wrong-aaaabbbbccccdddd"
MAX_BYTES = 64 * 1024
GAP_S = 0.5   # stub D: first token -> last chunk


class Router:
    def __init__(self, proc) -> None:
        m = proc.wait_line(r"READY router grpc=(\S+) http=(\S+) metrics=(\S+)")
        self.proc, self.grpc, self.http, self.metrics = proc, m.group(1), m.group(2), m.group(3)
        self.channel = grpc.insecure_channel(self.grpc)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.clients: list[openai.OpenAI] = []

    def openai(self, key: str) -> openai.OpenAI:
        self.clients.append(openai.OpenAI(base_url=f"http://{self.http}/v1", api_key=key, max_retries=0))
        return self.clients[-1]

    def stop(self) -> None:
        for c in self.clients:   # keep-alive connections would hold up the router's HTTP shutdown
            c.close()
        self.channel.close()
        self.proc.stop()

    def post(self, path: str, body: bytes, headers: dict) -> tuple[int, dict, dict]:
        """Raw HTTP POST: (status, JSON body, headers)."""
        req = urllib.request.Request(f"http://{self.http}{path}", data=body, method="POST",
                                     headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read()), dict(resp.headers)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read()), dict(exc.headers)

    def metrics_text(self) -> str:
        return urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=10).read().decode()


def _md(key: str | None):
    return None if key is None else [("authorization", f"Bearer {key}")]


def _generate(stub, key, request_id="", text="Hello", timeout=30) -> list:
    return list(stub.Generate(router_pb2.GenerateRequest(request_id=request_id, text=text,
                                                         sampling=common_pb2.SamplingParams(max_tokens=3)),
                              metadata=_md(key), timeout=timeout))


def _start(tmp_path, addrs, extra, api_key=""):
    proc = start_router(tmp_path, prefill=[addrs[0]], decode=[addrs[1]], extra=extra)
    try:
        wait_router_sees(proc, 2, api_key=api_key)
        return Router(proc)
    except BaseException:
        proc.stop()
        raise


@pytest.fixture(scope="module")
def seen():
    return []


@pytest.fixture(scope="module")
def door(tmp_path_factory, seen):
    tmp = tmp_path_factory.mktemp("door")
    key_file = tmp / "keys"
    key_file.write_text("# tenants of the test\n" + "".join(f"{t} {k}  # {t}'s key\n" for t, k in KEYS.items()))
    key_file.chmod(0o600)
    with stub_workers(GAP_S, seen=seen) as addrs:
        r = _start(tmp, addrs, ["--api-key-file", str(key_file), "--api-key", DEFAULT_KEY,
                                "--max-request-bytes", str(MAX_BYTES)], api_key=DEFAULT_KEY)
        yield r
        r.stop()


def test_http_missing_or_unknown_key_is_401_openai_shaped(door):
    for key in (WRONG_KEY, ""):
        with pytest.raises(openai.AuthenticationError) as info:
            door.openai(key or "x").completions.create(model="", prompt="Hello", max_tokens=2)
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    for headers in ({}, {"Authorization": f"Bearer {WRONG_KEY}"}, {"Authorization": f"Basic {KEYS['alice']}"}):
        status, err, h = door.post("/v1/completions", body, headers)
        assert status == 401, (headers, err)
        assert err["error"]["type"] == "invalid_request_error" and err["error"]["code"] == "invalid_api_key"
        assert h.get("www-authenticate") == "Bearer"
        assert WRONG_KEY not in json.dumps(err) and KEYS["alice"] not in json.dumps(err)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://{door.http}/v1/models", timeout=10)
    assert info.value.code == 401


def test_grpc_missing_or_unknown_key_is_unauthenticated(door):
    calls = {"Generate": lambda md: list(door.stub.Generate(router_pb2.GenerateRequest(text="Hi"), metadata=md)),
             "Abort": lambda md: door.stub.Abort(common_pb2.AbortRequest(request_id="x"), metadata=md),
             "ListModels": lambda md: door.stub.ListModels(router_pb2.ListModelsRequest(), metadata=md),
             "ListWorkers": lambda md: door.stub.ListWorkers(router_pb2.ListWorkersRequest(), metadata=md)}
    for name, call in calls.items():
        for md in (None, _md(WRONG_KEY), [("authorization", KEYS["bob"])]):   # the last: no "Bearer"
            with pytest.raises(grpc.RpcError) as info:
                call(md)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, md, info.value)
            assert WRONG_KEY not in info.value.details() and KEYS["bob"] not in info.value.details()


def test_good_keys_work_on_http_and_grpc(door):
    out = door.openai(KEYS["alice"]).completions.create(model="", prompt="Hello", max_tokens=3)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    chat = door.openai(DEFAULT_KEY).chat.completions.create(model="", max_tokens=3,
                                                           messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].finish_reason == "length"
    assert [m.id for m in door.openai(KEYS["bob"]).models.list().data]
    assert _generate(door.stub, KEYS["bob"])[-1].finish_reason == "length"
    assert len(door.stub.ListWorkers(router_pb2.ListWorkersRequest(), metadata=_md(KEYS["bob"])).workers) == 2


def test_health_and_metrics_are_open(door):
    with urllib.request.urlopen(f"http://{door.http}/health", timeout=10) as resp:
        assert resp.status == 200
    assert "halfmoon_router_requests_total" in door.metrics_text()
    status = health_pb2_grpc.HealthStub(door.channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING


def _stream_in_thread(stub, key, request_id):
    """Start Generate; returns (first response event, results list, thread)."""
    first, results = threading.Event(), []

    def run():
        try:
            for resp in door_stream(stub, key, request_id):
                results.append(resp)
                first.set()
        except grpc.RpcError as exc:
            results.append(exc.code())
        first.set()

    t = threading.Thread(target=run)
    t.start()
    return first, results, t


def door_stream(stub, key, request_id):
    return stub.Generate(router_pb2.GenerateRequest(request_id=request_id, text="Hello",
                                                    sampling=common_pb2.SamplingParams(max_tokens=3)),
                         metadata=_md(key), timeout=30)


def test_another_tenants_abort_finds_nothing(door):
    first, results, t = _stream_in_thread(door.stub, KEYS["alice"], "job-1")
    assert first.wait(10)
    found = door.stub.Abort(common_pb2.AbortRequest(request_id="job-1"), metadata=_md(KEYS["bob"])).found
    t.join(30)
    assert found is False
    assert results[-1].finish_reason == "length", results     # alice's request ran to its end
    # the same Abort by the owner reaches it (so the check above is not vacuous)
    first, results, t = _stream_in_thread(door.stub, KEYS["alice"], "job-2")
    assert first.wait(10)
    assert door.stub.Abort(common_pb2.AbortRequest(request_id="job-2"), metadata=_md(KEYS["alice"])).found
    t.join(30)
    assert results[-1].finish_reason == "abort", results


def test_tenants_use_the_same_request_id_at_once(door, seen):
    a = _stream_in_thread(door.stub, KEYS["alice"], "same")
    b = _stream_in_thread(door.stub, KEYS["bob"], "same")
    assert a[0].wait(10) and b[0].wait(10)
    with pytest.raises(grpc.RpcError) as info:          # within one tenant the id is still taken
        _generate(door.stub, KEYS["alice"], request_id="same")
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    for _, results, t in (a, b):
        t.join(30)
        assert results[-1].finish_reason == "length" and results[-1].request_id == "same", results
    ids = {rid for _, rid in seen}
    assert {"alice/same", "bob/same"} <= ids and "same" not in ids   # unique on the workers


def test_oversize_body_is_413_and_grpc_resource_exhausted(door):
    big = json.dumps({"prompt": "x" * (MAX_BYTES + 10), "max_tokens": 2}).encode()
    status, err, _ = door.post("/v1/completions", big, {"Authorization": f"Bearer {KEYS['alice']}"})
    assert status == 413 and err["error"]["code"] == "request_too_large" and "--max-request-bytes" in err["error"]["message"]
    conn = http.client.HTTPConnection(*door.http.split(":"), timeout=30)   # chunked: no Content-Length
    conn.putrequest("POST", "/v1/completions")
    for k, v in (("Authorization", f"Bearer {KEYS['alice']}"), ("Content-Type", "application/json"),
                 ("Transfer-Encoding", "chunked")):
        conn.putheader(k, v)
    conn.endheaders()
    try:
        for i in range(0, len(big), 16384):
            part = big[i:i + 16384]
            conn.send(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        conn.send(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass   # the router may answer and close before the last chunk
    resp = conn.getresponse()
    assert resp.status == 413, resp.read()
    conn.close()
    with pytest.raises(grpc.RpcError) as info:
        _generate(door.stub, KEYS["alice"], text="x" * (MAX_BYTES + 10))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _generate(door.stub, KEYS["alice"], text="x" * 1000)[-1].finish_reason == "length"  # under the limit


def test_metrics_have_a_bounded_tenant_label_and_no_key(door):
    text = door.metrics_text()
    tenants = {line.split('tenant="')[1].split('"')[0] for line in text.splitlines()
               if line.startswith("halfmoon_router_requests_total{")}
    assert tenants == {"alice", "bob", "default"}

    def value(prefix):
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))

    assert value('halfmoon_router_requests_total{policy="cache_aware/cache_aware",status="ok",tenant="alice"}') >= 3
    assert value('halfmoon_router_requests_total{policy="cache_aware/cache_aware",status="ok",tenant="bob"}') >= 2
    assert value('halfmoon_router_time_to_first_token_seconds_count{tenant="alice"}') >= 3
    assert value('halfmoon_router_auth_failures_total{api="grpc",reason="invalid"}') >= 4
    assert value('halfmoon_router_auth_failures_total{api="http",reason="missing"}') >= 1
    for key in (*KEYS.values(), DEFAULT_KEY, WRONG_KEY):
        assert key not in text


def test_no_key_in_the_log(door):
    log = door.proc.log()
    assert "API keys required: 3 key(s), tenants alice, bob, default" in log
    for key in (*KEYS.values(), DEFAULT_KEY, WRONG_KEY):
        assert key not in log
    assert_clean_log(door.proc)


LIMITED = {**KEYS, "carol": "sk-carol-1111", "dave": "sk-dave-2222", "erin": "sk-erin-3333"}


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """Rate limit 0.5 request/s per tenant (burst 1), admission queue of 2; the stub D holds the
    first token 1 s, so requests stay queued that long."""
    tmp = tmp_path_factory.mktemp("limited")
    key_file = tmp / "keys"
    key_file.write_text("".join(f"{t} {k}\n" for t, k in LIMITED.items()))
    key_file.chmod(0o600)
    with stub_workers(0.05, first_delay_s=1.0) as addrs:
        r = _start(tmp, addrs, ["--api-key-file", str(key_file), "--rate-limit-rps", "0.5", "--rate-limit-burst", "1",
                                "--max-queued-requests", "2"], api_key=KEYS["bob"])
        yield r
        r.stop()


def test_rate_limit_is_429_with_retry_after_per_tenant(limited):
    client = limited.openai(KEYS["alice"])
    assert client.completions.create(model="", prompt="Hello", max_tokens=2).choices[0].finish_reason == "length"
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model="", prompt="Hello", max_tokens=2)
    assert info.value.status_code == 429 and info.value.code == "rate_limit_exceeded"
    retry_after = int(info.value.response.headers["retry-after"])
    assert 1 <= retry_after <= 2
    with pytest.raises(grpc.RpcError) as exc:
        _generate(limited.stub, KEYS["alice"])
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(exc.value.trailing_metadata())["retry-after"] in ("1", "2")
    time.sleep(retry_after)
    assert client.completions.create(model="", prompt="Hello", max_tokens=2).choices[0].finish_reason == "length"
    assert _generate(limited.stub, KEYS["bob"])[-1].finish_reason == "length"    # bob has his own bucket
    text = limited.metrics_text()
    assert 'halfmoon_router_requests_total{policy="cache_aware/cache_aware",status="rate_limited",tenant="alice"} 2.0' \
        in text


def test_admission_queue_bound_is_429_and_resource_exhausted(limited):
    waiting = [_stream_in_thread(limited.stub, LIMITED[t], f"q-{t}") for t in ("carol", "dave")]
    time.sleep(0.4)   # both admitted, waiting for their first token
    assert "halfmoon_router_queued_requests 2.0" in limited.metrics_text()
    with pytest.raises(openai.RateLimitError) as info:
        limited.openai(LIMITED["erin"]).completions.create(model="", prompt="Hello", max_tokens=2)
    assert info.value.code == "queue_full" and info.value.response.headers["retry-after"] == "1"
    with pytest.raises(grpc.RpcError) as exc:
        _generate(limited.stub, LIMITED["erin"])
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queued-requests" in exc.value.details()
    for _, results, t in waiting:
        t.join(30)
        assert results[-1].finish_reason == "length", results
    # room again, and the refusals took none of erin's rate-limit tokens
    assert _generate(limited.stub, LIMITED["erin"])[-1].finish_reason == "length"
    assert "halfmoon_router_queued_requests 0.0" in limited.metrics_text()
    assert_clean_log(limited.proc)
