"""Command-line flags that pick a target (router gRPC or OpenAI HTTP) and the ``/metrics`` to scrape.

Shared by ``halfmoon bench serve`` and ``halfmoon eval``. Precedence: explicit flags, then the
endpoints file of ``halfmoon up`` (``--endpoints`` or ``$HALFMOON_ENDPOINTS``), then defaults.
"""

from __future__ import annotations

import argparse
import json
import os

from bench import endpoints

DEFAULT_ROUTER = "127.0.0.1:50050"  # `halfmoon up`'s router gRPC port (base port)


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--target", choices=("router", "openai"), default="router",
                   help="router: halfmoon.v1.Router.Generate over gRPC (default); openai: any "
                        "OpenAI-compatible server through the openai client")
    g.add_argument("--endpoints", default=os.environ.get("HALFMOON_ENDPOINTS"),
                   help="endpoints JSON written by `halfmoon up` (default $HALFMOON_ENDPOINTS)")
    g.add_argument("--router", help=f"router gRPC host:port (default from --endpoints, else {DEFAULT_ROUTER})")
    g.add_argument("--openai-url", help="OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    g.add_argument("--model", default="", help="model name to request (default: the server's first)")
    g.add_argument("--api-key", default=None,
                   help="router API key, both targets (default: $HALFMOON_API_KEY, $OPENAI_API_KEY, the "
                        "api_key in --endpoints, else none)")
    g.add_argument("--extra-body", type=json.loads, default=None,
                   help='extra JSON fields for every OpenAI request, e.g. \'{"top_k": 1}\'')
    g.add_argument("--send-text", action="store_true",
                   help="router target: send prompt text even when token ids are known")
    g.add_argument("--request-timeout", type=float, default=600.0, help="per-request timeout (s)")
    g.add_argument("--metrics-url", action="append", default=[],
                   help="a worker's /metrics URL (or host:port) to scrape before and after; repeatable "
                        "(default: the metrics URLs in --endpoints)")
    g.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics")


def resolve(args: argparse.Namespace) -> endpoints.Endpoints:
    """The endpoints to use (flags over the endpoints file).

    Raises:
        SystemExit: ``--target openai`` without an OpenAI URL.
    """
    ep = endpoints.load(args.endpoints) if args.endpoints else endpoints.Endpoints()
    router = args.router or ep.router or DEFAULT_ROUTER
    openai_url = args.openai_url or ep.openai_url
    metrics = [endpoints.normalize_metrics_url(u) for u in args.metrics_url] or ep.metrics_urls
    if args.no_metrics:
        metrics = []
    if args.target == "openai" and not openai_url:
        raise SystemExit("--target openai needs --openai-url (or an --endpoints file with one)")
    api_key = args.api_key or os.environ.get("HALFMOON_API_KEY") or os.environ.get("OPENAI_API_KEY") or ep.api_key
    return endpoints.Endpoints(router=router, openai_url=openai_url, metrics_urls=metrics, api_key=api_key)


def make_target(args: argparse.Namespace, ep: endpoints.Endpoints):
    """A :class:`~bench.router_target.RouterTarget` or :class:`~bench.openai_target.OpenAITarget`
    (imported only when chosen: the ``openai`` package comes with the ``bench`` extra)."""
    if args.target == "router":
        from bench.router_target import RouterTarget

        return RouterTarget(ep.router, model=args.model, send_text=args.send_text,
                            timeout_s=args.request_timeout, api_key=ep.api_key)
    try:
        from bench.openai_target import OpenAITarget
    except ImportError as e:
        raise SystemExit(f"--target openai needs the openai package: pip install 'halfmoon[bench]' ({e})") from e
    return OpenAITarget(ep.openai_url, model=args.model, api_key=ep.api_key or "EMPTY",
                        extra_body=args.extra_body, timeout_s=args.request_timeout)


def describe(args: argparse.Namespace, ep: endpoints.Endpoints) -> str:
    return ep.router if args.target == "router" else ep.openai_url
