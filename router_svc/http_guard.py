"""The OpenAI HTTP server's front door, as ASGI middleware (docs/architecture.md, The router's front door).

- Every ``/v1/*`` route needs ``Authorization: Bearer <key>`` when keys are configured: a missing or
  unknown key is HTTP 401 with OpenAI's body ``{"error": {"message", "type": "invalid_request_error",
  "param": null, "code": "invalid_api_key"}}`` and ``WWW-Authenticate: Bearer``. ``/health`` stays open
  (``/metrics`` is on its own port). The tenant goes to the app in ``request.state.tenant``.
- A request body larger than ``--max-request-bytes`` is HTTP 413, by ``Content-Length`` before any
  byte is read, or while reading a chunked body; the app sees the body only once it is whole.
"""

from __future__ import annotations

import json
import logging

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from telemetry import metrics as M
from router_svc.api_keys import ApiKeys, bearer_token

log = logging.getLogger("halfmoon.router.auth")

MISSING = "missing API key: send the header 'Authorization: Bearer <key>'"
INVALID = "invalid API key"


def _is_api_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


async def _answer(send: Send, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


def _error(message: str, etype: str, code: str) -> dict:
    return {"error": {"message": message, "type": etype, "param": None, "code": code}}


class FrontDoorMiddleware:
    """Authentication of ``/v1/*`` and the request body size limit.

    Args:
        app: the ASGI app (the OpenAI FastAPI app).
        keys: configured keys; none means open (every caller is ``anonymous``).
        max_body_bytes: largest accepted request body (0 = no limit).
    """

    def __init__(self, app: ASGIApp, keys: ApiKeys, max_body_bytes: int = 0) -> None:
        self.app = app
        self.keys = keys
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if _is_api_path(scope["path"]):
            token = bearer_token(headers.get("authorization"))
            tenant = self.keys.tenant_of(token)
            if tenant is None:
                reason = "missing" if token is None else "invalid"
                M.ROUTER_AUTH_FAILURES.labels(api="http", reason=reason).inc()
                log.debug("HTTP %s: %s API key", scope["path"], reason)
                await _answer(send, 401, _error(MISSING if token is None else INVALID, "invalid_request_error",
                                                "invalid_api_key"), {"WWW-Authenticate": "Bearer"})
                return
            scope.setdefault("state", {})["tenant"] = tenant
        if not self.max_body_bytes:
            await self.app(scope, receive, send)
            return
        length = headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _too_large(self, send: Send) -> None:
        await _answer(send, 413, _error(f"request body larger than {self.max_body_bytes} bytes "
                                        f"(--max-request-bytes)", "invalid_request_error", "request_too_large"),
                      {"Connection": "close"})


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body once, then the connection's own messages (the app watches for a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


__all__ = ["FrontDoorMiddleware"]
