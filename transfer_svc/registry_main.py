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
    parser.add_argument("--registry-backend", choices=["memory", "etcd"], default="memory",
                        help="where records live: in this process (lost on restart) or in etcd "
                             "(shared by every registry replica, kept across restarts)")
    parser.add_argument("--etcd-endpoints", default="",
                        help="etcd host:port[,host:port...] (with --registry-backend etcd)")
    parser.add_argument("--etcd-prefix", default="/halfmoon/default/",
                        help="key prefix of this cluster's records in etcd (one per cluster)")
    parser.add_argument("--etcd-ca", default="", help="CA file: talk https to etcd")
    parser.add_argument("--etcd-cert", default="", help="client certificate file for etcd (with --etcd-key)")
    parser.add_argument("--etcd-key", default="", help="client key file for etcd")
    parser.add_argument("--log-level", default="INFO")
    add_cluster_auth_args(parser)


def _backend(args: argparse.Namespace):
    """-> (backend or None for the default, error message or "")."""
    etcd_flags = {"--etcd-endpoints": args.etcd_endpoints, "--etcd-ca": args.etcd_ca,
                  "--etcd-cert": args.etcd_cert, "--etcd-key": args.etcd_key,
                  "--etcd-prefix": args.etcd_prefix != "/halfmoon/default/"}
    if args.registry_backend == "memory":
        given = [f for f, v in etcd_flags.items() if v]
        return None, (f"{given[0]} needs --registry-backend etcd" if given else "")
    if not args.etcd_endpoints:
        return None, "--registry-backend etcd needs --etcd-endpoints host:port[,...]"
    if bool(args.etcd_cert) != bool(args.etcd_key):
        return None, "--etcd-cert and --etcd-key go together"
    if args.etcd_cert and not args.etcd_ca:
        return None, "--etcd-cert needs --etcd-ca (client certificates are for https)"
    from transfer_svc.registry_backend import BackendUnavailable
    from transfer_svc.registry_etcd import EtcdBackend
    try:
        return EtcdBackend([e.strip() for e in args.etcd_endpoints.split(",") if e.strip()],
                           args.etcd_prefix, ca_cert=args.etcd_ca or None,
                           cert=args.etcd_cert or None, key=args.etcd_key or None), ""
    except ValueError as e:
        return None, f"--etcd-endpoints / --etcd-prefix: {e}"
    except BackendUnavailable as e:
        return None, f"--etcd-endpoints {args.etcd_endpoints}: {e}"


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
    backend, err = _backend(args)
    if err:
        print(err, file=sys.stderr)
        return 2
    server, servicer, port = serve(args.host, args.port, default_ttl_s=args.ttl,
                                   max_workers=args.max_workers, backend=backend, credentials=credentials)
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
