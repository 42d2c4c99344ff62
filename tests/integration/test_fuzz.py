"""Fuzz every public RPC (Router, Prefill, Decode, Registry) and every OpenAI HTTP route of the router
with hypothesis, against one real stack (registry + 1 P + 1 D + router, the real model).

Inputs (tests/integration/fuzz_inputs.py): requests built from the proto descriptors (any subset of
fields, NaN/inf, integer limits, empty/huge strings and lists, unknown enum values), their wire bytes
mutated (invalid UTF-8, an unknown field, truncated, garbage); HTTP bodies with one field of a valid
body given a wrong type, an unknown field, random JSON, raw bytes (invalid UTF-8, NaN tokens).

Every answer must be OK or a client status (INVALID_ARGUMENT naming a field of the request, HTTP 4xx
with an OpenAI error body naming the field), never UNKNOWN / INTERNAL / HTTP 5xx. Afterwards: every
process is alive and serves, no log holds a traceback or an ERROR line, and KV accounting is idle
and balanced on both workers.

The ``fuzz`` hypothesis profile is derandomized with a bounded number of examples, so a CI run is
reproducible and the file stays within its time budget; HALFMOON_FUZZ_EXAMPLES scales it up locally.
"""

from __future__ import annotations

import os
import re
import time

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos import common_pb2, decode_pb2, prefill_pb2, registry_pb2, router_pb2
from tests.integration.conftest import (MODEL, assert_clean_log, assert_idle_accounting, get_load, model_available,
                                        start_router, start_stack, wait_router_sees)
from tests.integration.fuzz_inputs import BASES, PROTECTED_IDS, mutated_bodies, proto_messages, wire_bytes

pytestmark = pytest.mark.skipif(not model_available(), reason=f"model {MODEL} is not pulled")

EXAMPLES = int(os.environ.get("HALFMOON_FUZZ_EXAMPLES", "30"))
settings.register_profile("fuzz", max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                  HealthCheck.function_scoped_fixture])
FUZZ = settings.get_profile("fuzz")

# Client statuses an input may earn. UNAVAILABLE: a decode request naming an unreachable P;
# DEADLINE_EXCEEDED: our own client deadline on a valid request that is still running.
CLIENT_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.PERMISSION_DENIED,
                grpc.StatusCode.UNAUTHENTICATED}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # Short destination / KV-wait / write windows: a fuzzed decode request that named the real P
    # ends (and its pages leave quarantine) within seconds, so accounting can be checked at the end.
    with start_stack(tmp_path_factory.mktemp("fuzz"), prefill_extra=["--destination-timeout", "3"],
                     decode_extra=["--kv-wait-timeout", "4", "--kv-write-window", "2",
                                   "--fence-margin", "1"]) as st_:
        router = start_router(st_.log_dir, registry=st_.registry.address)
        st_.procs.append(router)
        try:
            wait_router_sees(router, 2)
            http = re.search(r"READY router grpc=\S+ http=(\S+)", router.log()).group(1)
            yield {"stack": st_, "router": router, "http": f"http://{http}",
                   "registry": st_.registry, "prefill": st_.prefill, "decode": st_.decode, "leases": []}
        finally:
            router.stop()


# (server, service, method, request class, response streaming, client timeout s)
RPCS = [
    ("router", "Router", "Generate", router_pb2.GenerateRequest, True, 4.0),
    ("router", "Router", "Abort", common_pb2.AbortRequest, False, 5.0),
    ("router", "Router", "ListModels", router_pb2.ListModelsRequest, False, 5.0),
    ("router", "Router", "ListWorkers", router_pb2.ListWorkersRequest, False, 5.0),
    ("prefill", "Prefill", "Prefill", prefill_pb2.PrefillRequest, False, 2.0),
    ("prefill", "Prefill", "SetDestination", prefill_pb2.KVDestination, False, 5.0),
    ("prefill", "Prefill", "Abort", common_pb2.AbortRequest, False, 5.0),
    ("prefill", "Prefill", "GetLoad", common_pb2.GetLoadRequest, False, 5.0),
    ("decode", "Decode", "Generate", decode_pb2.DecodeRequest, True, 3.0),
    ("decode", "Decode", "Abort", common_pb2.AbortRequest, False, 5.0),
    ("decode", "Decode", "GetLoad", common_pb2.GetLoadRequest, False, 5.0),
    ("registry", "Registry", "RegisterSegment", registry_pb2.RegisterSegmentRequest, False, 5.0),
    ("registry", "Registry", "GetSegment", registry_pb2.GetSegmentRequest, False, 5.0),
    ("registry", "Registry", "Heartbeat", registry_pb2.HeartbeatRequest, False, 5.0),
    ("registry", "Registry", "Unregister", registry_pb2.UnregisterRequest, False, 5.0),
    ("registry", "Registry", "WatchWorkers", registry_pb2.WatchWorkersRequest, True, 2.0),
]
# The router names the OpenAI fields the request maps onto.
ALIASES = {"Router": {"prompt", "messages"}}


def _field_names(desc, seen=None) -> set[str]:
    seen = set() if seen is None else seen
    if desc.full_name in seen:
        return set()
    seen.add(desc.full_name)
    names = set()
    for f in desc.fields:
        names.add(f.name)
        if f.message_type is not None:
            names |= _field_names(f.message_type, seen)
    return names


def _touches_protected(msg) -> bool:
    """A registry call that would take over or remove the stack's own workers (registry ownership,
    issue 16, is tested elsewhere)."""
    ids = {getattr(msg, "worker_id", "") or getattr(msg, "name", "")}
    if isinstance(msg, registry_pb2.RegisterSegmentRequest):
        ids = {msg.worker.worker_id, msg.worker.segment.name}
    return bool(ids & set(PROTECTED_IDS))


def _call(address: str, path: str, streaming: bool, raw: bytes, timeout: float):
    """(status code, details, responses as bytes)."""
    with grpc.insecure_channel(address) as ch:
        try:
            if streaming:
                call = ch.unary_stream(path, request_serializer=None, response_deserializer=None)(raw, timeout=timeout)
                out = []
                for resp in call:
                    out.append(resp)
                    if path.endswith("WatchWorkers"):   # an endless stream: its first event is enough
                        call.cancel()
                        break
                return grpc.StatusCode.OK, "", out
            resp = ch.unary_unary(path, request_serializer=None, response_deserializer=None)(raw, timeout=timeout)
            return grpc.StatusCode.OK, "", [resp]
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and path.endswith("WatchWorkers"):
                return grpc.StatusCode.OK, "", []
            return exc.code(), exc.details() or "", []


def _check_rpc(servers, rpc, kind: str, raw: bytes, msg) -> None:
    server, service, method, cls, streaming, timeout = rpc
    path = f"/halfmoon.v1.{service}/{method}"
    code, details, out = _call(servers[server].address, path, streaming, raw, timeout)
    where = f"{path} ({kind}) {raw[:200]!r}: {code} {details!r}"
    assert code in CLIENT_CODES, where
    if kind == "invalid_utf8":
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.endswith(": invalid UTF-8"), where
    elif kind == "unknown_field":
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown field" in details, where
    if code == grpc.StatusCode.INVALID_ARGUMENT and kind in ("none", "invalid_utf8"):
        first = re.match(r"[A-Za-z_][\w]*", details)
        names = _field_names(cls.DESCRIPTOR) | ALIASES.get(service, set())
        assert first and first.group(0) in names, f"{where}: names no field of {cls.DESCRIPTOR.name}"
    if code == grpc.StatusCode.OK and method == "RegisterSegment":   # unregister what we added
        lease = registry_pb2.RegisterSegmentResponse.FromString(out[0]).lease_id
        servers["leases"].append((msg.worker.worker_id, lease))


@pytest.mark.parametrize("rpc", RPCS, ids=[f"{r[1]}.{r[2]}" for r in RPCS])
def test_rpc_fuzz(stack, rpc):
    cls = rpc[3]
    inputs = wire_bytes(proto_messages(cls.DESCRIPTOR, cls)).filter(lambda t: not _touches_protected(t[2]))

    @FUZZ
    @given(inputs)
    def run(case):
        kind, raw, msg = case
        _check_rpc(stack, rpc, kind, raw, msg)

    run()
    _assert_alive(stack)


HTTP_ROUTES = sorted(BASES)


def _assert_openai_error(resp: httpx.Response, where: str) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), where
    return body["error"]


@pytest.mark.parametrize("route", HTTP_ROUTES)
def test_http_fuzz(stack, route):
    url = stack["http"] + route

    @settings(FUZZ, max_examples=EXAMPLES * 4)
    @given(mutated_bodies(route), st.booleans())
    def run(case, stream):
        kind, body, field = case
        where = f"{route} ({kind}, field {field}) {body[:300]!r}"
        try:
            resp = httpx.post(url, content=body, headers={"content-type": "application/json"},
                              timeout=httpx.Timeout(10, read=4))
        except httpx.ReadTimeout:   # a valid request still generating; closing it cancels it
            assert kind == "any_value", where
            return
        where += f" -> {resp.status_code} {resp.text[:300]!r}"
        assert resp.status_code < 500, where
        if resp.status_code == 200:
            assert kind == "any_value", where
            return
        err = _assert_openai_error(resp, where)
        assert 400 <= resp.status_code < 500, where
        if field is not None:
            assert resp.status_code == 400 and err["param"] == field, where
        else:
            assert err["param"] or err["message"].startswith("body"), where

    run()
    _assert_alive(stack)


def test_http_routes_and_methods(stack):
    """The GET routes answer; unknown routes and wrong methods are 404 / 405, never 5xx."""
    base = stack["http"]
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    assert httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
    for method, path in [("GET", "/v1/completions"), ("PUT", "/v1/chat/completions"), ("POST", "/v1/models"),
                         ("DELETE", "/health"), ("GET", "/v1/nope"), ("POST", "/" + "x" * 5000)]:
        resp = httpx.request(method, base + path, timeout=10)
        assert resp.status_code in (404, 405), (method, path, resp.status_code, resp.text)
        _assert_openai_error(resp, f"{method} {path}: {resp.text}")


def _assert_alive(servers) -> None:
    for name in ("registry", "prefill", "decode", "router"):
        proc = servers[name]
        assert proc.popen.poll() is None, f"{name} died:\n{proc.log()[-4000:]}"
    for service in ("prefill", "decode"):
        assert get_load(servers[service].address, service).accounting.total_pages > 0


def test_zz_after_fuzz_all_serve_clean_and_idle(stack):
    """Runs last in the module: the fuzzed stack still serves a real request, accounting is idle and
    balanced, and no process logged a traceback or an ERROR line."""
    from protos import registry_pb2_grpc, router_pb2_grpc

    with grpc.insecure_channel(stack["registry"].address) as ch:
        reg = registry_pb2_grpc.RegistryStub(ch)
        for worker_id, lease in stack["leases"]:
            reg.Unregister(registry_pb2.UnregisterRequest(worker_id=worker_id, lease_id=lease), timeout=10)
    _assert_alive(stack)
    deadline = time.monotonic() + 30
    with grpc.insecure_channel(stack["router"].address) as ch:
        while True:   # the router may still be retiring fuzz-registered workers
            try:
                resps = list(router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
                    text="Hello", sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0)), timeout=60))
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, exc
                time.sleep(0.5)
    assert resps[-1].finish_reason == "length" and sum(len(r.token_ids) for r in resps) == 3
    assert_idle_accounting(stack["stack"], timeout=60)
    for name in ("registry", "prefill", "decode", "router"):
        assert_clean_log(stack[name])
