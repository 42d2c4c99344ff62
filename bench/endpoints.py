"""Where the stack listens: router gRPC address, OpenAI base URL, workers' ``/metrics`` URLs.

Read from the endpoints JSON that ``halfmoon up`` writes (a file, or the JSON line it prints), and
overridden by explicit flags. The reader is tolerant of the exact layout: the router address is the
first of ``router_grpc`` / ``router`` / ``grpc`` found (a ``host:port`` string, or a dict holding
one of those keys), the OpenAI URL the first of ``openai_url`` / ``openai`` / ``http`` (at the top
or inside the ``router`` entry), and metrics
URLs are every string found under a key containing ``metrics`` anywhere in the document (of the
prefill and decode workers; the router's and registry's are kept too — their counters never
overlap the KV metrics, see :mod:`telemetry.metrics`). ``api_key`` is the router API key ``halfmoon up``
printed (top-level ``api_key``), if any.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

_ROUTER_KEYS = ("router_grpc", "router", "grpc")
_OPENAI_KEYS = ("openai_url", "openai", "http", "openai_base_url")


@dataclasses.dataclass
class Endpoints:
    router: str | None = None
    openai_url: str | None = None
    metrics_urls: list[str] = dataclasses.field(default_factory=list)
    api_key: str | None = dataclasses.field(default=None, repr=False)


def _first(doc: Any, keys: tuple[str, ...]) -> str | None:
    if not isinstance(doc, dict):
        return None
    for k in keys:
        v = doc.get(k)
        if isinstance(v, str) and v:
            return v
        if isinstance(v, dict):
            got = _first(v, keys + ("address", "url", "base_url"))
            if got:
                return got
    return None


def _metrics(doc: Any, under_metrics: bool = False) -> list[str]:
    out: list[str] = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _metrics(v, under_metrics or "metrics" in str(k).lower())
    elif isinstance(doc, list):
        for v in doc:
            out += _metrics(v, under_metrics)
    elif isinstance(doc, str) and doc and under_metrics:
        out.append(normalize_metrics_url(doc))
    elif isinstance(doc, int) and under_metrics and 0 < doc < 65536:
        out.append(normalize_metrics_url(f"127.0.0.1:{doc}"))
    return out


def normalize_metrics_url(url: str) -> str:
    """``host:port`` → ``http://host:port/metrics``; a URL without a path gets ``/metrics``."""
    if "://" not in url:
        url = "http://" + url
    scheme, rest = url.split("://", 1)
    if "/" not in rest:
        rest += "/metrics"
    return f"{scheme}://{rest}"


def parse(doc: dict[str, Any]) -> Endpoints:
    """Endpoints from a parsed endpoints JSON document."""
    openai_url = _first(doc, _OPENAI_KEYS) or (_first(doc.get("router"), _OPENAI_KEYS)
                                                if isinstance(doc, dict) else None)
    if openai_url and "://" not in openai_url:
        openai_url = "http://" + openai_url
    if openai_url and not openai_url.rstrip("/").endswith("/v1"):
        openai_url = openai_url.rstrip("/") + "/v1"
    seen: list[str] = []
    for u in _metrics(doc):
        if u not in seen:
            seen.append(u)
    key = doc.get("api_key") if isinstance(doc, dict) else None
    return Endpoints(router=_first(doc, _ROUTER_KEYS), openai_url=openai_url, metrics_urls=seen,
                     api_key=key if isinstance(key, str) and key else None)


def cluster_credentials(doc: dict[str, Any]):
    """The :class:`security.ClusterCredentials` for calling the workers and registry of the stack
    ``doc`` describes (its ``cluster_token``, or its client cert in ``tls``; none: an open cluster).

    Raises:
        security.CredentialsError: the ``tls`` files are missing or unreadable.
    """
    from security import ClusterCredentials

    tls = doc.get("tls") if isinstance(doc.get("tls"), dict) else {}
    token = doc.get("cluster_token") if isinstance(doc.get("cluster_token"), str) else None
    return ClusterCredentials.load(token=token or None, tls_cert=tls.get("cert"), tls_key=tls.get("key"),
                                   tls_ca=tls.get("ca"), env={})


def load(path: str | Path) -> Endpoints:
    """Endpoints from a file holding the JSON document, or a log of ``halfmoon up`` (its last line
    holding a ``{...}`` object, e.g. ``ENDPOINTS {...}``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: no JSON object in it.
    """
    text = Path(path).read_text()
    try:
        return parse(json.loads(text))
    except json.JSONDecodeError:
        for line in reversed(text.splitlines()):
            line = line.strip()
            if "{" in line and line.endswith("}"):
                try:
                    return parse(json.loads(line[line.index("{"):]))
                except json.JSONDecodeError:
                    continue
    raise ValueError(f"endpoints file {path}: no JSON object found")
