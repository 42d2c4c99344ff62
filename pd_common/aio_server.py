"""A worker's gRPC server on ``grpc.aio``, run from synchronous code: its event loop in one thread.

D serves ``Generate`` as coroutines (decode_svc/aio_server.py): every open stream is a task on one
loop instead of a server thread that blocks on its queue and again on each write (two thread
wake-ups per token per stream, under the GIL: the host cost per running request per step that a
large batch paid, docs/architecture.md, Decode streaming). Handlers that are plain functions
(``Abort``, ``GetLoad``, KVEvents, health) run in the server's ``migration_thread_pool``, so a busy
loop never delays a health check behind a stream.

The rest of the worker is synchronous (start-up, signals, drain), so :class:`LoopServer` runs the
loop in a daemon thread and exposes blocking ``start`` / ``stop``; :class:`LoopHealth` is the
``grpc.health.v1`` servicer with the synchronous ``set`` the worker calls.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1._async import HealthServicer


class LoopServer:
    """A ``grpc.aio.server`` and the loop thread it runs on.

    Args:
        threads: size of the pool that runs the non-coroutine handlers (``--grpc-threads``).
        interceptors: ``grpc.aio.ServerInterceptor`` list, outermost first.
        name: thread name prefix.
    """

    def __init__(self, threads: int, interceptors: list, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"{name}-loop", daemon=True)
        self._thread.start()
        pool = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"{name}-grpc")

        async def make():  # the aio server binds to the loop it is created on
            return grpc.aio.server(migration_thread_pool=pool, interceptors=interceptors)

        self.server = self.call(make())

    def call(self, coro, timeout: float | None = None):
        """Run ``coro`` on the loop and wait for its result (from any thread but the loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def add_generic_rpc_handlers(self, handlers) -> None:
        # the generated add_*Servicer_to_server helpers register through these two
        self.server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service_name, method_handlers) -> None:
        self.server.add_registered_method_handlers(service_name, method_handlers)

    def add_insecure_port(self, address: str) -> int:
        return self.server.add_insecure_port(address)

    def add_secure_port(self, address: str, credentials) -> int:
        return self.server.add_secure_port(address, credentials)

    def start(self) -> None:
        self.call(self.server.start())

    def stop(self, grace: float) -> None:
        """Stop serving (running calls get ``grace`` s), then the loop; blocking."""
        if self.loop.is_closed():
            return
        self.call(self.server.stop(grace))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)


class LoopHealth:
    """``grpc.health.v1`` on a :class:`LoopServer`: the aio servicer, with a blocking ``set``."""

    def __init__(self, server: LoopServer):
        self._server = server
        self._servicer = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    def set(self, service: str, status) -> None:
        if not self._server.loop.is_closed() and self._server.loop.is_running():
            self._server.call(self._servicer.set(service, status), timeout=10.0)
