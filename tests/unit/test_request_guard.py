"""protos.request_guard: the field path named for request bytes that do not parse (the servers
end such calls INVALID_ARGUMENT with it: tests/integration/test_invalid_utf8.py)."""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2, struct_pb2

from protos import common_pb2, router_pb2
from protos.request_guard import InvalidRequest, _guarded_deserializer

PLACEHOLDER = "~\x7f~\x7f"


def parse(msg, replacement: bytes = b"\xed\xa0\x80(") -> object:
    """``msg`` serialized with PLACEHOLDER swapped for ``replacement`` (default: a UTF-16 surrogate,
    which UTF-8 forbids), through the guarded deserializer of its type."""
    raw = msg.SerializeToString()
    assert raw.count(PLACEHOLDER.encode()) == 1
    return _guarded_deserializer(type(msg))(raw.replace(PLACEHOLDER.encode(), replacement))


def _struct(key: str, value: str) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.fields[key].list_value.values.add().string_value = value
    return s


@pytest.mark.parametrize("msg,path", [
    (router_pb2.GenerateRequest(request_id=PLACEHOLDER), "request_id"),
    (router_pb2.GenerateRequest(text=PLACEHOLDER), "text"),                                   # oneof member
    (router_pb2.GenerateRequest(text="ok", sampling=common_pb2.SamplingParams(stop=["a", "b", PLACEHOLDER])),
     "sampling.stop[2]"),
    (router_pb2.GenerateRequest(chat=router_pb2.ChatMessages(messages=[
        router_pb2.ChatMessage(role="user", content="hi"), router_pb2.ChatMessage(role=PLACEHOLDER)])),
     "chat.messages[1].role"),
    (_struct(PLACEHOLDER, "v"), "fields[0].key"),                                            # a map key
    (_struct("k", PLACEHOLDER), "fields[0].value.list_value.values[0].string_value"),
])
def test_invalid_utf8_names_the_field_path(msg, path):
    assert parse(msg) == InvalidRequest(f"{path}: invalid UTF-8")


def test_valid_bytes_parse_as_the_request_type():
    msg = router_pb2.GenerateRequest(text=PLACEHOLDER)
    assert parse(msg, PLACEHOLDER.encode()) == msg


def test_malformed_bytes_name_the_type():
    got = _guarded_deserializer(router_pb2.GenerateRequest)(b"\x0a\x05ab")   # a length past the end
    assert isinstance(got, InvalidRequest) and got.details.startswith("malformed halfmoon.v1.GenerateRequest: ")


def test_proto2_strings_are_not_validated():
    msg = descriptor_pb2.FileDescriptorProto(name=PLACEHOLDER)
    assert isinstance(parse(msg), descriptor_pb2.FileDescriptorProto)


def _with_unknown(raw: bytes, number: int = 15) -> bytes:
    return raw + bytes([number << 3]) + b"\x01"   # a varint field the type does not declare


def test_unknown_field_names_the_number_and_type():
    raw = _with_unknown(common_pb2.AbortRequest(request_id="r").SerializeToString())
    assert _guarded_deserializer(common_pb2.AbortRequest)(raw) == InvalidRequest(
        "unknown field number 15 in halfmoon.v1.AbortRequest")


def test_unknown_field_in_a_nested_message_names_its_path():
    sampling = _with_unknown(common_pb2.SamplingParams(max_tokens=2).SerializeToString())
    raw = router_pb2.GenerateRequest(text="hi").SerializeToString() + b"\x32" + bytes([len(sampling)]) + sampling
    assert _guarded_deserializer(router_pb2.GenerateRequest)(raw) == InvalidRequest(
        "sampling: unknown field number 15 in halfmoon.v1.SamplingParams")
    inner = _with_unknown(router_pb2.ChatMessage(role="user").SerializeToString(), 9)
    msgs = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user")]).SerializeToString()
    msgs += b"\x0a" + bytes([len(inner)]) + inner
    raw = b"\x2a" + bytes([len(msgs)]) + msgs   # chat (field 5): two messages, the second with field 9
    assert _guarded_deserializer(router_pb2.GenerateRequest)(raw) == InvalidRequest(
        "chat.messages[1]: unknown field number 9 in halfmoon.v1.ChatMessage")
