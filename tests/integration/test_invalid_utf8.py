"""Invalid UTF-8 in a proto3 ``string`` field, sent as raw bytes to every gRPC server we run (real
processes: registry, prefill and decode workers on sync gRPC, the router on grpc.aio): the call ends
INVALID_ARGUMENT naming the field's path, the server logs no traceback, and still serves a normal
request. Unary and server-streaming methods, nested and repeated fields, and the health and
reflection services the servers carry too (a client stream)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from protos import common_pb2, decode_pb2, prefill_pb2, registry_pb2, router_pb2
from tests.integration.conftest import (MODEL, assert_clean_log, get_load, model_available, start_router,
                                        start_stack, wait_router_sees)

pytestmark = pytest.mark.skipif(not model_available(), reason=f"model {MODEL} is not pulled")

PLACEHOLDER = "~\x7f~\x7f"      # serialized as these 4 bytes, swapped for as many invalid UTF-8 ones
INVALID = b"\xc3(\xc3("          # a lead byte followed by a non-continuation byte, twice


def invalid_utf8(msg) -> bytes:
    """``msg`` serialized, with its one PLACEHOLDER string replaced by invalid UTF-8."""
    raw = msg.SerializeToString()
    assert raw.count(PLACEHOLDER.encode()) == 1
    return raw.replace(PLACEHOLDER.encode(), INVALID)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with start_stack(tmp_path_factory.mktemp("utf8")) as st:
        router = start_router(st.log_dir, registry=st.registry.address)
        try:
            wait_router_sees(router, 2)
            yield {"registry": st.registry, "prefill": st.prefill, "decode": st.decode, "router": router}
        finally:
            router.stop()


def _sampling_with_bad_stop():
    return common_pb2.SamplingParams(max_tokens=2, stop=["fine", PLACEHOLDER])


# server, method, streaming response, request, field path named in the status
CASES = [
    ("router", "/halfmoon.v1.Router/Generate", True,
     router_pb2.GenerateRequest(text="Hello", sampling=_sampling_with_bad_stop()), "sampling.stop[1]"),
    ("router", "/halfmoon.v1.Router/Abort", False, common_pb2.AbortRequest(request_id=PLACEHOLDER), "request_id"),
    ("prefill", "/halfmoon.v1.Prefill/Prefill", False,
     prefill_pb2.PrefillRequest(request_id=PLACEHOLDER, room=1, input_ids=[1, 2]), "request_id"),
    ("prefill", "/halfmoon.v1.Prefill/SetDestination", False,
     prefill_pb2.KVDestination(room=1, decode_segment=PLACEHOLDER), "decode_segment"),
    ("decode", "/halfmoon.v1.Decode/Generate", True,
     decode_pb2.DecodeRequest(request_id="r", room=1, input_ids=[1], sampling=_sampling_with_bad_stop()),
     "sampling.stop[1]"),
    ("decode", "/halfmoon.v1.Decode/Abort", False, common_pb2.AbortRequest(reason=PLACEHOLDER), "reason"),
    ("registry", "/halfmoon.v1.Registry/GetSegment", False, registry_pb2.GetSegmentRequest(name=PLACEHOLDER), "name"),
    ("registry", "/halfmoon.v1.Registry/RegisterSegment", False, registry_pb2.RegisterSegmentRequest(
        worker=registry_pb2.WorkerRecord(worker_id="w", segment=registry_pb2.SegmentDescriptor(
            regions=[registry_pb2.MemoryRegion(location="cpu"), registry_pb2.MemoryRegion(location=PLACEHOLDER)]))),
     "worker.segment.regions[1].location"),
    ("router", "/grpc.health.v1.Health/Check", False, health_pb2.HealthCheckRequest(service=PLACEHOLDER), "service"),
    ("decode", "/grpc.health.v1.Health/Watch", True, health_pb2.HealthCheckRequest(service=PLACEHOLDER), "service"),
]
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


def _call(address: str, method: str, streaming: bool, raw: bytes):
    with grpc.insecure_channel(address) as ch:
        if streaming:
            return list(ch.unary_stream(method, request_serializer=None, response_deserializer=None)(raw, timeout=30))
        return ch.unary_unary(method, request_serializer=None, response_deserializer=None)(raw, timeout=30)


def _assert_invalid_argument(call, field: str) -> None:
    with pytest.raises(grpc.RpcError) as ei:
        call()
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (ei.value.code(), ei.value.details())
    assert ei.value.details() == f"{field}: invalid UTF-8"


def _assert_still_serves(servers, name: str) -> None:
    address = servers[name].address
    if name == "router":
        from protos import router_pb2_grpc

        with grpc.insecure_channel(address) as ch:
            resps = list(router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
                text="Hello", sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0)), timeout=120))
        assert resps[-1].finish_reason == "length" and sum(len(r.token_ids) for r in resps) == 2
    elif name == "registry":
        from protos import registry_pb2_grpc

        with grpc.insecure_channel(address) as ch:
            rec = registry_pb2_grpc.RegistryStub(ch).GetSegment(registry_pb2.GetSegmentRequest(name="prefill-0"),
                                                                timeout=10).worker
        assert rec.worker_id == "prefill-0"
    else:
        assert get_load(address, name).accounting.total_pages > 0


@pytest.mark.parametrize("name,method,streaming,request_msg,field", CASES,
                         ids=[f"{c[0]}-{c[1].rsplit('/', 2)[-2].rsplit('.', 1)[-1]}.{c[1].rsplit('/', 1)[-1]}"
                              for c in CASES])
def test_invalid_utf8_is_invalid_argument_naming_the_field(servers, name, method, streaming, request_msg, field):
    raw = invalid_utf8(request_msg)
    _assert_invalid_argument(lambda: _call(servers[name].address, method, streaming, raw), field)
    _assert_still_serves(servers, name)
    assert_clean_log(servers[name])


@pytest.mark.parametrize("name", ["router", "prefill", "registry"])
def test_invalid_utf8_in_a_client_stream_is_invalid_argument(servers, name):
    raw = invalid_utf8(reflection_pb2.ServerReflectionRequest(file_by_filename=PLACEHOLDER))
    with grpc.insecure_channel(servers[name].address) as ch:
        call = ch.stream_stream(REFLECTION, request_serializer=None, response_deserializer=None)
        _assert_invalid_argument(lambda: list(call(iter([raw]), timeout=30)), "file_by_filename")
    _assert_still_serves(servers, name)
    assert_clean_log(servers[name])
