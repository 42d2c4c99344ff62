"""API-key authentication of the router's gRPC service (docs/architecture.md, The router's front door).

Every ``halfmoon.v1.Router`` RPC needs the metadata ``authorization: Bearer <key>`` when keys are
configured; a missing or unknown key ends the call UNAUTHENTICATED before the request reaches the
servicer. ``grpc.health.v1`` and server reflection stay open (probes, tooling). The caller's
tenant is handed to the servicer in a context variable (:func:`current_tenant`), set by the
wrapped handler inside the RPC's own task, so it never leaks to another call.

    server = grpc.aio.server(interceptors=[AioApiKeyInterceptor(keys), AioInvalidRequestInterceptor()])
"""

from __future__ import annotations

import contextvars
import inspect
import logging

import grpc

from telemetry import metrics as M
from router_svc.api_keys import ANONYMOUS, ApiKeys, bearer_token

log = logging.getLogger("halfmoon.router.auth")

ROUTER_PREFIX = "/halfmoon.v1.Router/"
_TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("halfmoon_router_tenant", default=ANONYMOUS)

_KINDS = {(False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
          (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
          (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
          (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler)}

MISSING = "missing API key: send the metadata 'authorization: Bearer <key>'"
INVALID = "invalid API key"


def current_tenant() -> str:
    """The tenant of the Router RPC this task serves (``anonymous`` when the router is open)."""
    return _TENANT.get()


def _denying(behavior, message: str):
    if inspect.isasyncgenfunction(behavior):
        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - abort raises
        return deny_stream

    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
    return deny


def _with_tenant(behavior, tenant: str):
    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            _TENANT.set(tenant)
            responses = behavior(request, context)
            try:
                async for response in responses:
                    yield response
            finally:
                await responses.aclose()
        return stream

    async def unary(request, context):
        _TENANT.set(tenant)
        return await behavior(request, context)
    return unary


class AioApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """For ``grpc.aio.server``: Router RPCs need a known API key; sets :func:`current_tenant`.

    Args:
        keys: the configured keys; when it holds none, every call passes as ``anonymous``.
    """

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not self.keys.enabled or not handler_call_details.method.startswith(ROUTER_PREFIX):
            return handler
        token = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str):
                token = bearer_token(value)
        tenant = self.keys.tenant_of(token)
        attr, make = _KINDS[(handler.request_streaming, handler.response_streaming)]
        behavior = getattr(handler, attr)
        if tenant is None:
            reason = "missing" if token is None else "invalid"
            M.ROUTER_AUTH_FAILURES.labels(api="grpc", reason=reason).inc()
            log.debug("gRPC %s: %s API key", handler_call_details.method, reason)
            new = _denying(behavior, MISSING if token is None else INVALID)
        else:
            new = _with_tenant(behavior, tenant)
        return make(new, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


__all__ = ["AioApiKeyInterceptor", "current_tenant", "ROUTER_PREFIX"]
