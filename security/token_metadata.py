"""Client interceptors that add the cluster token to the metadata of every call on a channel (the
client half of :mod:`security.token_interceptor`). gRPC sends call credentials only over TLS, so on
a plaintext channel the token travels as metadata added here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from security.token_interceptor import TOKEN_METADATA_KEY


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


def _with_token(details, token: str):
    metadata = list(details.metadata or ()) + [(TOKEN_METADATA_KEY, token)]
    return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                        getattr(details, "wait_for_ready", None), getattr(details, "compression", None))


class TokenClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                             grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """For ``grpc.intercept_channel``: every call carries the token."""

    def __init__(self, token: str):
        self._token = token

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with_token(details, self._token), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_with_token(details, self._token), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(_with_token(details, self._token), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(_with_token(details, self._token), request_iterator)


def _aio_details(details, token: str):
    metadata = grpc.aio.Metadata(*(details.metadata or ()), (TOKEN_METADATA_KEY, token))
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str):
        self._token = token

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_aio_details(details, self._token), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self._token = token

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_aio_details(details, self._token), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, token: str):
        self._token = token

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_aio_details(details, self._token), request_iterator)


class _AioStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self._token = token

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_aio_details(details, self._token), request_iterator)


def aio_token_interceptors(token: str) -> list:
    """For ``grpc.aio.*_channel(interceptors=...)``: one per call kind (grpc.aio files each
    interceptor under one kind only)."""
    return [cls(token) for cls in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


__all__ = ["TokenClientInterceptor", "aio_token_interceptors"]
