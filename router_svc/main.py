"""``halfmoon serve-router``: the router process (gRPC ``halfmoon.v1.Router`` + OpenAI HTTP + /metrics).

Example::

    halfmoon serve-router --model smollm2-135m-instruct --port 50050 --http-port 8000 \\
        --metrics-port 9100 --registry 127.0.0.1:50053 --policy kv_events

Prints ``READY router grpc=<host:port> http=<host:port> metrics=<host:port>`` once serving. The
gRPC health status (service "" and "halfmoon.v1.Router") is SERVING while at least one healthy
prefill and one healthy decode worker are known, NOT_SERVING otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal

import grpc
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from engine.engine_args import non_negative_int
from engine.model_store import DEFAULT_MODEL, resolve_model
from telemetry.metrics import start_metrics_server, stop_metrics_servers
from protos import router_pb2, router_pb2_grpc
from protos.request_guard import AioInvalidRequestInterceptor
from security import ClusterCredentials, CredentialsError
from security.flags import add_cluster_auth_args
from router_svc import front_door
from router_svc.dispatch import Dispatcher
from router_svc.grpc_service import RouterServicer, SendAfterDeadlineFilter
from router_svc.kv_index import KVEventIndex
from router_svc.openai_api import build_app
from router_svc.local_prefill import LocalPrefillPolicy
from router_svc.pair_policy import KVPairPolicy, PairWeights
from router_svc.policies import POLICY_NAMES, make_policy
from router_svc.pool import WorkerPool
from router_svc.tokenizer import RouterTokenizer
from router_svc.worker import DECODE, PREFILL

log = logging.getLogger("halfmoon.router")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or HF directory (tokenizer, chat template)")
    p.add_argument("--host", default="127.0.0.1", help="bind address of gRPC, HTTP and metrics")
    p.add_argument("--port", type=int, default=50050, help="gRPC port (0 = pick a free one)")
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI HTTP port (0 = pick a free one)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0 = pick a free one)")
    p.add_argument("--registry", default="", help="registry host:port; workers come from WatchWorkers")
    p.add_argument("--prefill", default="", help="static prefill workers host:port,... (instead of --registry)")
    p.add_argument("--decode", default="", help="static decode workers host:port,... (instead of --registry)")
    p.add_argument("--policy", default="per_role", choices=("per_role", "kv_events"),
                   help="per_role: P and D each by its --prefill-policy / --decode-policy; kv_events: the pair "
                        "together, by the workers' KV events (router_svc/pair_policy.py)")
    p.add_argument("--prefill-policy", default=None, choices=POLICY_NAMES, help="with --policy per_role (default cache_aware)")
    p.add_argument("--decode-policy", default=None, choices=POLICY_NAMES, help="with --policy per_role (default cache_aware)")
    for name, default, what in (("prefill-token", 1.0, "per prompt token P computes"),
                                ("transfer-mib", 1.0, "per MiB of KV pages P writes to D"),
                                ("prefill-load", 64.0, "per request queued or running on P"),
                                ("decode-load", 8.0, "per request on D")):
        p.add_argument(f"--kv-{name}-weight", type=float, default=None,
                       help=f"with --policy kv_events: cost {what} (default {default})")
    p.add_argument("--local-prefill-max-tokens", type=int, default=0, metavar="N",
                   help="with --policy kv_events: send a request to a decode worker alone, which prefills it "
                        "itself, when it holds all but at most N prompt tokens (conditional disaggregation, "
                        "e.g. 256 for chat follow-ups and short new prompts; 0 = off)")
    p.add_argument("--local-prefill-queue", type=int, default=0, metavar="N",
                   help="with --policy kv_events: ... or when it holds part of the prompt and every prefill "
                        "worker has N or more requests queued or running (0 = off)")
    p.add_argument("--max-context", type=int, default=None, metavar="N",
                   help="tokens per request served, prompt + output (vLLM's --max-model-len; default: the "
                        "model's window, which N may not exceed): /v1/models' max_model_len, the default "
                        "max_tokens (the rest of it) and the limit longer requests get a 400 "
                        "context_length_exceeded for; workers registered with a smaller --max-context are "
                        "not used")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (cache_aware prefix matching)")
    p.add_argument("--health-interval", type=float, default=0.5, help="seconds between worker health/load polls")
    p.add_argument("--max-attempts", type=int, default=2, help="PD pairs tried per request (2 = retry once)")
    p.add_argument("--first-token-timeout", type=float, default=120.0,
                   help="seconds without any sign of life from D (a token, or a keepalive of a request "
                        "queued there: serve-decode --queue-keepalive) before the first token, after "
                        "which the attempt fails and is retried; --request-timeout still bounds the total")
    p.add_argument("--migration-limit", type=non_negative_int, default=3,
                   help="times a stream may move to another prefill/decode pair when its decode worker "
                        "fails or drains after tokens were sent (prompt + those tokens re-dispatched; the "
                        "client's stream goes on from the next token); 0 = never (UNAVAILABLE)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="deadline (seconds) when the client sets none")
    p.add_argument("--log-level", default="INFO")
    # for the router's channels to workers and registry; its own face to clients is API-key based
    add_cluster_auth_args(p)
    front_door.add_arguments(p)


_WEIGHTS = ("prefill_token", "transfer_mib", "prefill_load", "decode_load")


def pair_policy_from_args(args: argparse.Namespace) -> KVPairPolicy | None:
    """The ``kv_events`` pair policy of the flags, or None with ``--policy per_role``.

    Raises:
        SystemExit: a flag of the other mode was given (it would be ignored), or a negative weight.
    """
    given = {w: getattr(args, f"kv_{w}_weight") for w in _WEIGHTS if getattr(args, f"kv_{w}_weight") is not None}
    if args.policy == "per_role":
        if given:
            flag = "--kv-" + next(iter(given)).replace("_", "-") + "-weight"
            raise SystemExit(f"serve-router: {flag} needs --policy kv_events")
        return None
    for flag, v in (("--prefill-policy", args.prefill_policy), ("--decode-policy", args.decode_policy)):
        if v is not None:
            raise SystemExit(f"serve-router: {flag} is for --policy per_role; --policy kv_events picks the pair")
    try:
        weights = PairWeights(**given)
    except ValueError as e:
        raise SystemExit(f"serve-router: {e}") from None
    return KVPairPolicy(KVEventIndex(), args.page_size, weights)


def local_prefill_from_args(args: argparse.Namespace, pair: KVPairPolicy | None) -> LocalPrefillPolicy | None:
    """Conditional disaggregation of the flags (it reads D's cached prefix from the pair policy's
    index), or None when both thresholds are 0.

    Raises:
        SystemExit: a threshold without ``--policy kv_events``, or a negative one.
    """
    tail, queue = args.local_prefill_max_tokens, args.local_prefill_queue
    if not (tail or queue):
        return None
    if pair is None:
        flag = "--local-prefill-max-tokens" if tail else "--local-prefill-queue"
        raise SystemExit(f"serve-router: {flag} needs --policy kv_events (D's cached prefix comes from KV events)")
    try:
        return LocalPrefillPolicy(pair.index, args.page_size, max_tail_tokens=tail, prefill_queue=queue)
    except ValueError as e:
        raise SystemExit(f"serve-router: {e}") from None


def _split(s: str) -> list[str]:
    return [a.strip() for a in s.split(",") if a.strip()]


async def serve(args: argparse.Namespace) -> int:
    try:
        credentials = ClusterCredentials.from_args(args)
    except CredentialsError as e:
        raise SystemExit(f"serve-router: {e}") from None
    log.info("cluster identity toward workers and registry: %s", credentials.mode)
    door = front_door.FrontDoor.from_args(args)
    model_dir = resolve_model(args.model)
    try:
        tok = RouterTokenizer(args.model if not os.path.isdir(args.model) else model_dir.name, model_dir,
                              max_context=args.max_context)
    except ValueError as e:
        raise SystemExit(f"serve-router: {e}") from None
    pool = WorkerPool(model_names=(tok.card.id, str(model_dir)), health_interval=args.health_interval,
                      credentials=credentials, max_context=tok.card.max_context)
    pair_policy = pair_policy_from_args(args)
    if pair_policy is not None:
        pool.kv_index = pair_policy.index
    dispatcher = Dispatcher(tok, pool, make_policy(args.prefill_policy or "cache_aware", args.page_size),
                            make_policy(args.decode_policy or "cache_aware", args.page_size),
                            max_attempts=args.max_attempts, first_token_timeout=args.first_token_timeout,
                            migration_limit=args.migration_limit,
                            request_timeout=args.request_timeout, admission=door.admission,
                            tenants=door.keys.tenants, pair_policy=pair_policy,
                            local_prefill=local_prefill_from_args(args, pair_policy))
    if args.registry:
        pool.watch_registry(args.registry)
    pool.add_static(_split(args.prefill), _split(args.decode))
    if not args.registry and not (args.prefill and args.decode):
        raise SystemExit("serve-router: give --registry, or both --prefill and --decode")

    logging.getLogger("grpc._cython.cygrpc").addFilter(SendAfterDeadlineFilter())
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)] + door.grpc_options(),
                             interceptors=[door.grpc_interceptor(), AioInvalidRequestInterceptor()])
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(dispatcher), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = (router_pb2.DESCRIPTOR.services_by_name["Router"].full_name, reflection.SERVICE_NAME,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    reflection.enable_server_reflection(names, server)
    grpc_port = server.add_insecure_port(f"{args.host}:{args.port}")
    if grpc_port == 0:
        raise SystemExit(f"serve-router: cannot bind gRPC {args.host}:{args.port}")
    await server.start()
    metrics_port = start_metrics_server(args.metrics_port, args.host, role="router", worker_id="router",
                                        model=tok.card.id)

    config = uvicorn.Config(door.http_app(build_app(dispatcher)), host=args.host, port=args.http_port,
                            log_level="warning", lifespan="off")
    http = uvicorn.Server(config)
    http.capture_signals = contextlib.nullcontext  # SIGINT/SIGTERM are ours (below), not uvicorn's
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    http_task = asyncio.ensure_future(http.serve())
    while not http.started:
        if http_task.done():
            raise SystemExit(f"serve-router: HTTP server failed to start on {args.host}:{args.http_port}")
        await asyncio.sleep(0.05)
    http_port = http.servers[0].sockets[0].getsockname()[1]

    async def track_health() -> None:
        last = None
        while True:
            ok = pool.healthy_count(PREFILL) > 0 and pool.healthy_count(DECODE) > 0
            if ok != last:
                status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
                for name in ("", names[0]):
                    await health.set(name, status)
                last = ok
            await asyncio.sleep(0.1)

    health_task = asyncio.ensure_future(track_health())
    door.log_startup()
    print(f"READY router grpc={args.host}:{grpc_port} http={args.host}:{http_port} "
          f"metrics={args.host}:{metrics_port}", flush=True)
    await asyncio.wait({asyncio.ensure_future(stop.wait()), http_task}, return_when=asyncio.FIRST_COMPLETED)
    log.info("shutting down")
    health_task.cancel()
    await health.enter_graceful_shutdown()
    http.should_exit = True
    await server.stop(grace=2.0)
    await asyncio.wait({http_task}, timeout=5.0)
    await pool.close()
    stop_metrics_servers(metrics_port)
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(args))
