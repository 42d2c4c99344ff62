"""The router's one error type: a gRPC status code, a message, and the offending request field.

The gRPC service aborts with ``code`` and ``message``; the OpenAI HTTP layer maps ``code`` to an HTTP
status and writes the standard body ``{"error": {"message", "type", "param", "code"}}``. An error
with ``retry_after`` is the router's own overload answer (rate limit, admission queue): HTTP 429 with
``Retry-After``, type ``requests`` as OpenAI's rate-limit errors, and ``retry-after`` trailing
metadata on gRPC.
"""

from __future__ import annotations

import grpc

# gRPC status -> (HTTP status, OpenAI error type)
_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),   # request_id already running
    # Workers queue requests while their KV pool is busy; RESOURCE_EXHAUSTED from them means "can
    # never fit", so it is a 400 (a 429 would make clients retry a request that cannot succeed).
    grpc.StatusCode.RESOURCE_EXHAUSTED: (400, "invalid_request_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}


class RouterError(Exception):
    """A request the router cannot serve.

    Attributes:
        code: the gRPC status code returned to gRPC clients.
        message: human-readable reason; names the field when ``param`` is set.
        param: the request field at fault (``"max_tokens"``, ``"messages"``, ...), or None.
        err_code: short machine code for OpenAI bodies (``"model_not_found"``, ...), or None.
        retry_after: whole seconds a client should wait before retrying (router overload), or None.
    """

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None,
                 err_code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.err_code = err_code
        self.retry_after = retry_after

    @classmethod
    def invalid(cls, param: str, message: str, err_code: str | None = None) -> "RouterError":
        """INVALID_ARGUMENT naming ``param``; the message is prefixed with the field name."""
        return cls(grpc.StatusCode.INVALID_ARGUMENT, f"{param}: {message}", param, err_code)

    def _http(self) -> tuple[int, str]:
        if self.retry_after is not None:
            return 429, "requests"
        return _HTTP.get(self.code, (500, "internal_error"))

    @property
    def http_status(self) -> int:
        return self._http()[0]

    @property
    def http_headers(self) -> dict[str, str]:
        """``Retry-After`` when set."""
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def grpc_trailers(self) -> tuple[tuple[str, str], ...]:
        """``retry-after`` trailing metadata when set."""
        return () if self.retry_after is None else (("retry-after", str(self.retry_after)),)

    def openai_body(self) -> dict:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        etype = self._http()[1]
        return {"error": {"message": self.message, "type": etype, "param": self.param,
                          "code": self.err_code or self.code.name.lower()}}
