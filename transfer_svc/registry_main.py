"""`halfmoon serve-transfer`: run the transfer registry (gRPC halfmoon.v1.Registry + /metrics)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from security import ClusterCredentials, CredentialsError
from security.flags import add_cluster_auth_args
from telemetry import metrics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="gRPC bind address")
    parser.add_argument("--port", type=int, default=50050, help="gRPC port (0 = pick a free one)")
    parser.add_argument("--metrics-port", type=int, default=9450,
                        help="Prometheus /metrics port (0 = pick a free one, -1 = none)")
    parser.add_argument("--ttl", type=int, default=10,
                        help="default lease TTL in seconds (registrations may ask for another)")
    parser.add_argument("--max-workers", type=int, default=256,
                        help="gRPC threads; each open WatchWorkers stream holds one")
    parser.add_argument("--log-level", default="INFO")
    add_cluster_auth_args(parser)


def run(args: argparse.Namespace) -> int:
    from transfer_svc.registry import serve

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.ttl <= 0:
        print("--ttl must be > 0 seconds", file=sys.stderr)
        return 2
    try:
        credentials = ClusterCredentials.from_args(args)
    except CredentialsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    server, servicer, port = serve(args.host, args.port, default_ttl_s=args.ttl,
                                   max_workers=args.max_workers, credentials=credentials)
    logging.getLogger("halfmoon.registry").info("cluster identity: %s", credentials.mode)
    metrics_port = None
    if args.metrics_port >= 0:
        metrics_port = metrics.start_metrics_server(args.metrics_port, role="registry",
                                                    worker_id="registry")
    # One line for launchers and tests to parse.
    print(f"registry listening grpc={args.host}:{port} metrics={metrics_port}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    servicer.stop()
    server.stop(grace=1.0).wait()
    if metrics_port is not None:
        metrics.stop_metrics_servers(metrics_port)
    return 0
