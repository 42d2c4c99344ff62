"""Client interceptors that add fixed metadata to every call on a channel: the cluster token (the
client half of :mod:`security.token_interceptor`) or a router API key (``authorization: Bearer``).
gRPC sends call credentials only over TLS, so on a plaintext channel they travel as metadata added
here.

    ch = grpc.intercept_channel(grpc.insecure_channel(addr), MetadataClientInterceptor(pairs))
    ch = grpc.aio.insecure_channel(addr, interceptors=aio_metadata_interceptors(pairs))
    ch = bearer_channel(router_addr, api_key)     # a sync channel to the router with the API key
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc



@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


Pairs = tuple[tuple[str, str], ...]


def _with_pairs(details, pairs: Pairs):
    metadata = list(details.metadata or ()) + list(pairs)
    return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                        getattr(details, "wait_for_ready", None), getattr(details, "compression", None))


class MetadataClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """For ``grpc.intercept_channel``: every call carries ``pairs`` ((key, value), ...)."""

    def __init__(self, pairs: Pairs):
        self._pairs = tuple(pairs)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with_pairs(details, self._pairs), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_with_pairs(details, self._pairs), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(_with_pairs(details, self._pairs), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(_with_pairs(details, self._pairs), request_iterator)


def _aio_details(details, pairs: Pairs):
    metadata = grpc.aio.Metadata(*(details.metadata or ()), *pairs)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, pairs: Pairs):
        self._pairs = tuple(pairs)

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_aio_details(details, self._pairs), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, pairs: Pairs):
        self._pairs = tuple(pairs)

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_aio_details(details, self._pairs), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, pairs: Pairs):
        self._pairs = tuple(pairs)

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_aio_details(details, self._pairs), request_iterator)


class _AioStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, pairs: Pairs):
        self._pairs = tuple(pairs)

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_aio_details(details, self._pairs), request_iterator)


def aio_metadata_interceptors(pairs: Pairs) -> list:
    """For ``grpc.aio.*_channel(interceptors=...)``: one per call kind (grpc.aio files each
    interceptor under one kind only)."""
    return [cls(pairs) for cls in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


def bearer_metadata(api_key: str | None) -> Pairs:
    """``authorization: Bearer <api_key>`` (empty without a key), the router's API-key metadata."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def bearer_channel(address: str, api_key: str | None, options=None) -> grpc.Channel:
    """A plaintext sync channel to the router that sends ``api_key`` on every call (none: plain)."""
    ch = grpc.insecure_channel(address, options)
    return grpc.intercept_channel(ch, MetadataClientInterceptor(bearer_metadata(api_key))) if api_key else ch


def aio_bearer_channel(address: str, api_key: str | None, options=None) -> grpc.aio.Channel:
    """The ``grpc.aio`` twin of :func:`bearer_channel`."""
    return grpc.aio.insecure_channel(address, options,
                                     interceptors=aio_metadata_interceptors(bearer_metadata(api_key)) if api_key else None)


__all__ = ["MetadataClientInterceptor", "aio_bearer_channel", "aio_metadata_interceptors", "bearer_channel",
           "bearer_metadata"]
