"""A worker's gRPC server: its service, KVEvents when published, grpc.health.v1 (NOT_SERVING until
the worker publishes itself) and reflection, bound under the cluster credentials. Threaded
(``grpc.server``, one pool thread per open call) or ``grpc.aio`` on its own loop thread
(``pd_common/aio_server.py``) for a service with coroutine handlers."""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.request_guard import InvalidRequestInterceptor
from security import ClusterCredentials


@dataclass
class Served:
    """A started server: ``server`` (``grpc.Server`` or ``LoopServer``), its ``health`` servicer and
    the bound ``port``."""

    server: object
    health: object
    port: int


def start_grpc_server(add_service, service_name: str, *, host: str, port: int, threads: int, role: str,
                      credentials: ClusterCredentials, kv_events=None, aio: bool = False) -> Served:
    """Build, bind and start the server on ``host:port`` (0: a free port) with ``threads`` pool
    threads; ``add_service(server)`` adds the service named ``service_name``; ``kv_events`` (a
    ``KVEventPublisher``) is served next to it when given. Health starts NOT_SERVING.

    Raises:
        OSError: the address cannot be bound.
    """
    if aio:
        from pd_common.aio_server import LoopHealth, LoopServer
        from protos.request_guard import AioInvalidRequestInterceptor

        server = LoopServer(threads, [*credentials.aio_server_interceptors(), AioInvalidRequestInterceptor()], role)
    else:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"{role}-grpc"),
                             interceptors=[*credentials.server_interceptors(), InvalidRequestInterceptor()])
    add_service(server)
    names = [service_name]
    if kv_events is not None:
        from pd_common import kv_events as kv_events_svc

        kv_events_svc.add_to_server(kv_events, server)
        names.append(kv_events_svc.SERVICE_NAME)
    if aio:
        health_servicer = LoopHealth(server)
    else:
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", service_name):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server.server if aio else server)
    bound = credentials.add_port(server, f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    server.start()
    return Served(server, health_servicer, bound)
