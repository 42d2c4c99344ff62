"""A request whose bytes do not parse, or that carries a field its type does not declare, ends
INVALID_ARGUMENT naming the field, on every gRPC server.

A proto3 ``string`` field holding invalid UTF-8 fails in the request deserializer, before any
servicer code runs: grpc logs a traceback and ends the call INTERNAL (sync server) or UNKNOWN
(grpc.aio), naming no field. The interceptors here swap each handler's request deserializer for
one that, on a decode error, parses the same bytes with a twin of the request type whose string
fields are ``bytes`` (built at runtime from the descriptors), finds the first of them that is not
UTF-8, and hands the handler a marker instead of a request: the call ends INVALID_ARGUMENT
``"<field path>: invalid UTF-8"`` (``sampling.stop[1]: invalid UTF-8``) before the servicer runs.

A field number the request type does not declare (a client built from another version of the
protos, or a typo'd field) would be kept as an unknown field and silently ignored by proto3; here
it ends INVALID_ARGUMENT ``"sampling: unknown field number 15 in halfmoon.v1.SamplingParams"``
(docs/architecture.md, Invariants: nothing accepted is ignored).

    server = grpc.server(executor, interceptors=[InvalidRequestInterceptor()])
    server = grpc.aio.server(interceptors=[AioInvalidRequestInterceptor()])
"""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory
from google.protobuf.unknown_fields import UnknownFieldSet
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor

# Twins live in a pool of their own under the original names, so references between messages and
# files stay as they are.
_TWINS = descriptor_pool.DescriptorPool()
_TWINS_LOCK = threading.Lock()


@dataclass(frozen=True)
class InvalidRequest:
    """What the guarded deserializer returns for bytes that do not parse; ``details`` is the status
    message."""
    details: str


def _bytes_for_strings(fields) -> None:
    for f in fields:
        if f.type == FieldDescriptor.TYPE_STRING:
            f.type = FieldDescriptor.TYPE_BYTES


def _twin_message(msg: descriptor_pb2.DescriptorProto) -> None:
    _bytes_for_strings(msg.field)
    _bytes_for_strings(msg.extension)
    if msg.options.map_entry:  # a map key cannot be bytes; the entries parse the same as messages
        msg.options.ClearField("map_entry")
    for nested in msg.nested_type:
        _twin_message(nested)


def _add_twin_file(fd: FileDescriptor) -> None:
    try:
        _TWINS.FindFileByName(fd.name)
        return
    except KeyError:
        pass
    for dep in fd.dependencies:
        _add_twin_file(dep)
    proto = descriptor_pb2.FileDescriptorProto()
    fd.CopyToProto(proto)
    _bytes_for_strings(proto.extension)
    for msg in proto.message_type:
        _twin_message(msg)
    _TWINS.AddSerializedFile(proto.SerializeToString())


@functools.lru_cache(maxsize=None)
def _twin_class(desc: Descriptor) -> type[message.Message]:
    with _TWINS_LOCK:
        _add_twin_file(desc.file)
    return message_factory.GetMessageClass(_TWINS.FindMessageTypeByName(desc.full_name))


def _invalid_utf8_path(twin: message.Message, desc: Descriptor) -> str | None:
    """Path of the first string field of ``desc`` whose bytes in ``twin`` are not UTF-8."""
    for tf, value in twin.ListFields():
        f = desc.fields_by_number.get(tf.number)
        if f is None or (f.type != FieldDescriptor.TYPE_STRING and f.message_type is None):
            continue
        items = value if f.is_repeated else [value]
        for i, item in enumerate(items):
            name = f"{f.name}[{i}]" if f.is_repeated else f.name
            if f.type == FieldDescriptor.TYPE_STRING:
                try:
                    item.decode("utf-8")
                except UnicodeDecodeError:
                    return name
            else:
                sub = _invalid_utf8_path(item, f.message_type)
                if sub is not None:
                    return f"{name}.{sub}"
    return None


def undecodable_details(cls: type[message.Message], data: bytes, error: Exception) -> str:
    """The status message for ``data`` that ``cls`` failed to parse with ``error``."""
    desc = cls.DESCRIPTOR
    try:
        path = _invalid_utf8_path(_twin_class(desc).FromString(data), desc)
    except message.DecodeError:
        path = None
    if path is None:
        return f"malformed {desc.full_name}: {error}"
    return f"{path}: invalid UTF-8"


def unknown_field_details(msg: message.Message, path: str = "") -> str | None:
    """The status message for the first field of ``msg`` (or of a message inside it) that its type
    does not declare, or None when there is none."""
    unknown = UnknownFieldSet(msg)
    if len(unknown):
        where = f"{path}: " if path else ""
        return f"{where}unknown field number {unknown[0].field_number} in {msg.DESCRIPTOR.full_name}"
    for f, value in msg.ListFields():
        if f.message_type is None:
            continue
        if f.message_type.GetOptions().map_entry:
            items = [(f"{f.name}[{k!r}]", v) for k, v in value.items() if isinstance(v, message.Message)]
        elif f.is_repeated:
            items = [(f"{f.name}[{i}]", v) for i, v in enumerate(value)]
        else:
            items = [(f.name, value)]
        for name, sub in items:
            found = unknown_field_details(sub, f"{path}.{name}" if path else name)
            if found:
                return found
    return None


def _guarded_deserializer(cls: type[message.Message]):
    def deserialize(data: bytes):
        try:
            msg = cls.FromString(data)
        except message.DecodeError as exc:
            return InvalidRequest(undecodable_details(cls, data, exc))
        unknown = unknown_field_details(msg)
        return msg if unknown is None else InvalidRequest(unknown)
    return deserialize


def _request_class(deserializer) -> type[message.Message] | None:
    cls = getattr(deserializer, "__self__", None)   # a generated stub passes ``Message.FromString``
    return cls if isinstance(cls, type) and issubclass(cls, message.Message) else None


# (request_streaming, response_streaming) -> the handler's behavior attribute and its constructor
_KINDS = {(False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
          (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
          (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
          (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler)}


def _guard(handler, guard_behavior):
    """``handler`` with the guarded deserializer and ``guard_behavior(behavior, request_streaming)``
    around its behavior; unchanged when its requests are not protobuf messages or the behavior is
    of a kind the guard does not know (None)."""
    if handler is None:
        return None
    cls = _request_class(handler.request_deserializer)
    attr, make = _KINDS[(handler.request_streaming, handler.response_streaming)]
    behavior = guard_behavior(getattr(handler, attr), handler.request_streaming) if cls else None
    if behavior is None:
        return handler
    return make(behavior, request_deserializer=_guarded_deserializer(cls),
                response_serializer=handler.response_serializer)


def _abort_sync(request, context) -> None:
    if isinstance(request, InvalidRequest):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)


def _checked_requests(requests, context):
    for request in requests:
        _abort_sync(request, context)
        yield request


def _guard_sync(behavior, request_streaming: bool):
    def guarded(request, context):
        if request_streaming:
            return behavior(_checked_requests(request, context), context)
        _abort_sync(request, context)
        return behavior(request, context)
    return guarded


async def _abort_aio(request, context) -> None:
    if isinstance(request, InvalidRequest):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)


async def _checked_requests_aio(requests, context):
    async for request in requests:
        await _abort_aio(request, context)
        yield request


async def _checked_aio(request, context, request_streaming: bool):
    if request_streaming:
        return _checked_requests_aio(request, context)
    await _abort_aio(request, context)
    return request


def _guard_aio(behavior, request_streaming: bool):
    """grpc.aio picks how to run a behavior by its kind, so the guard keeps it: a coroutine
    function stays one, an async generator function stays one, and a plain function (run in the
    server's thread pool with a synchronous context: D's Abort, GetLoad, KVEvents) gets the
    synchronous guard."""
    if inspect.isasyncgenfunction(behavior):
        async def guarded_stream(request, context):
            responses = behavior(await _checked_aio(request, context, request_streaming), context)
            try:
                async for response in responses:
                    yield response
            finally:
                await responses.aclose()
        return guarded_stream
    if inspect.iscoroutinefunction(behavior):
        async def guarded(request, context):
            return await behavior(await _checked_aio(request, context, request_streaming), context)
        return guarded
    return _guard_sync(behavior, request_streaming)


class InvalidRequestInterceptor(grpc.ServerInterceptor):
    """For ``grpc.server``: undecodable requests and unknown fields end INVALID_ARGUMENT naming the
    field."""

    def intercept_service(self, continuation, handler_call_details):
        return _guard(continuation(handler_call_details), _guard_sync)


class AioInvalidRequestInterceptor(grpc.aio.ServerInterceptor):
    """For ``grpc.aio.server``: undecodable requests and unknown fields end INVALID_ARGUMENT naming
    the field."""

    async def intercept_service(self, continuation, handler_call_details):
        return _guard(await continuation(handler_call_details), _guard_aio)


__all__ = ["AioInvalidRequestInterceptor", "InvalidRequest", "InvalidRequestInterceptor", "undecodable_details",
           "unknown_field_details"]
