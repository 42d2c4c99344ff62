"""The router's front door: its flags and what they build (docs/architecture.md, The router's front door).

API keys and tenants (:mod:`router_svc.api_keys`), checked on gRPC (:mod:`router_svc.grpc_auth`)
and HTTP (:mod:`router_svc.http_guard`); per-tenant rate limits and the admission queue
(:mod:`router_svc.admission`); request size limits (HTTP 413, gRPC ``max_receive_message_length``).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from router_svc.admission import Admission
from router_svc.api_keys import ENV_VAR, ApiKeys, KeyFileError, file_is_private, load_keys
from router_svc.grpc_auth import AioApiKeyInterceptor
from router_svc.http_guard import FrontDoorMiddleware

log = logging.getLogger("halfmoon.router")

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # gRPC's own default receive limit


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The front door's flags of ``halfmoon serve-router``."""
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help=f"accept this API key, tenant 'default' (repeatable; also ${ENV_VAR}); "
                        "no key at all = open")
    p.add_argument("--api-key-file", default="", metavar="FILE",
                   help="API keys, one '<tenant> <key>' per line, '#' comments")
    p.add_argument("--rate-limit-rps", type=float, default=0.0,
                   help="generation requests per second per tenant (token bucket; 0 = off)")
    p.add_argument("--rate-limit-burst", type=int, default=0,
                   help="token bucket size per tenant (0 = ceil(--rate-limit-rps), at least 1)")
    p.add_argument("--max-queued-requests", type=int, default=0,
                   help="most requests admitted and waiting for their first token (0 = unbounded); "
                        "more get HTTP 429 / RESOURCE_EXHAUSTED")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest HTTP request body (413) and gRPC request message (RESOURCE_EXHAUSTED)")


@dataclass
class FrontDoor:
    """What the front door flags configure.

    Attributes:
        keys: API keys (none: open).
        admission: rate limits and admission queue bound.
        max_request_bytes: request size limit, bytes (> 0).
    """

    keys: ApiKeys
    admission: Admission
    max_request_bytes: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "FrontDoor":
        """Raises SystemExit with a message naming the flag (and file line) for bad values."""
        try:
            keys = load_keys(args.api_key, args.api_key_file)
        except KeyFileError as exc:
            raise SystemExit(f"serve-router: {exc}") from None
        try:
            admission = Admission(args.rate_limit_rps, args.rate_limit_burst, args.max_queued_requests)
        except ValueError as exc:
            raise SystemExit(f"serve-router: {exc}") from None
        if args.max_request_bytes < 1:
            raise SystemExit(f"serve-router: --max-request-bytes must be >= 1, got {args.max_request_bytes}")
        if args.api_key_file and not file_is_private(args.api_key_file):
            log.warning("--api-key-file %s is readable by group or others (chmod 600 it)", args.api_key_file)
        return cls(keys, admission, args.max_request_bytes)

    def log_startup(self) -> None:
        """One line on how callers are authenticated and limited (never a key)."""
        if self.keys.enabled:
            auth = f"API keys required: {len(self.keys.entries)} key(s), tenants {', '.join(self.keys.tenants)}"
        else:
            auth = "no API key configured: the router is open to every caller (tenant 'anonymous')"
        a = self.admission
        rate = f"{a.rate_rps:g} req/s burst {a.burst} per tenant" if a.rate_rps else "off"
        log.info("%s; rate limit %s; admission queue %s; max request %d bytes", auth, rate,
                 a.max_queued or "unbounded", self.max_request_bytes)

    def grpc_options(self) -> list[tuple[str, int]]:
        return [("grpc.max_receive_message_length", self.max_request_bytes)]

    def grpc_interceptor(self) -> AioApiKeyInterceptor:
        return AioApiKeyInterceptor(self.keys)

    def http_app(self, app):
        """``app`` behind the API key check and the body size limit."""
        return FrontDoorMiddleware(app, self.keys, self.max_request_bytes)


__all__ = ["FrontDoor", "add_arguments", "DEFAULT_MAX_REQUEST_BYTES"]
