"""Server interceptors that refuse, with UNAUTHENTICATED, every RPC whose metadata lacks the right
cluster token (``x-halfmoon-cluster-token``).

The token is compared with :func:`hmac.compare_digest` (constant time) and never logged or echoed.
A refused call gets a handler of the same streaming kind whose deserializer ignores the request
bytes, so nothing of an unauthenticated request is parsed or allocated. Put it first in the chain
(before ``protos.request_guard``): an unauthenticated caller learns nothing about its payload.

``grpc.health.v1.Health`` stays open: kubelet gRPC probes and load balancers cannot send metadata,
and a health answer says only SERVING / NOT_SERVING, nothing a caller could use to take part in the
cluster. Everything else (the services, server reflection) needs the token.

    server = grpc.server(executor, interceptors=[TokenInterceptor(token), InvalidRequestInterceptor()])
    server = grpc.aio.server(interceptors=[AioTokenInterceptor(token), ...])
"""

from __future__ import annotations

import hmac

import grpc

TOKEN_METADATA_KEY = "x-halfmoon-cluster-token"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
REFUSAL = f"missing or wrong cluster token (metadata {TOKEN_METADATA_KEY})"

_MAKERS = {(False, False): grpc.unary_unary_rpc_method_handler,
           (False, True): grpc.unary_stream_rpc_method_handler,
           (True, False): grpc.stream_unary_rpc_method_handler,
           (True, True): grpc.stream_stream_rpc_method_handler}


_UNREAD = object()  # what a refused call's request becomes (grpc treats a None request as a parse error)


def _ignore_bytes(_data: bytes) -> object:
    return _UNREAD


def token_ok(expected: bytes, handler_call_details) -> bool:
    """Whether the call is open (health) or carries ``expected`` in its metadata."""
    if handler_call_details.method.startswith(OPEN_PREFIXES):
        return True
    for key, value in handler_call_details.invocation_metadata or ():
        if key == TOKEN_METADATA_KEY:
            got = value.encode() if isinstance(value, str) else value
            return hmac.compare_digest(got, expected)
    return False


def _check(token: str) -> bytes:
    if not token:
        raise ValueError("the cluster token is empty")
    return token.encode()


class TokenInterceptor(grpc.ServerInterceptor):
    """For ``grpc.server``: RPCs without the cluster token end UNAUTHENTICATED.

    Raises:
        ValueError: an empty ``token``.
    """

    def __init__(self, token: str):
        self._token = _check(token)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or token_ok(self._token, handler_call_details):
            return handler

        def refuse(_request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

        return _MAKERS[(handler.request_streaming, handler.response_streaming)](
            refuse, request_deserializer=_ignore_bytes, response_serializer=handler.response_serializer)


class AioTokenInterceptor(grpc.aio.ServerInterceptor):
    """For ``grpc.aio.server``: RPCs without the cluster token end UNAUTHENTICATED.

    Raises:
        ValueError: an empty ``token``.
    """

    def __init__(self, token: str):
        self._token = _check(token)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or token_ok(self._token, handler_call_details):
            return handler

        async def refuse(_request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

        return _MAKERS[(handler.request_streaming, handler.response_streaming)](
            refuse, request_deserializer=_ignore_bytes, response_serializer=handler.response_serializer)


__all__ = ["AioTokenInterceptor", "OPEN_PREFIXES", "TOKEN_METADATA_KEY", "TokenInterceptor", "token_ok"]
