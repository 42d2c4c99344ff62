"""Scripted prefill and decode workers (sync gRPC servers in the test process), for a real router
process whose timing or error paths a test controls. D streams the first token ``first_delay_s``
after the call (default at once) and the rest ``gap_s`` later; P answers at once. Request ids the
workers were sent go to ``seen`` when given.

With ``keepalive_s`` D sends an empty chunk every ``keepalive_s`` while it holds the first token
back (as a real D does for a queued request), except for request ids containing "silent", and one
more empty chunk between its two token chunks (which a real D never sends: the router must not
relay it)."""

from __future__ import annotations

import contextlib
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

TOKENS = [1000, 1001, 1002]


class StubWorker(prefill_pb2_grpc.PrefillServicer, decode_pb2_grpc.DecodeServicer):
    def __init__(self, gap_s: float, first_delay_s: float = 0.0, seen: list | None = None,
                 keepalive_s: float = 0.0) -> None:
        self.gap_s = gap_s
        self.first_delay_s = first_delay_s
        self.keepalive_s = keepalive_s
        self.seen = seen if seen is not None else []

    def Prefill(self, request, context):
        self.seen.append(("prefill", request.request_id))
        return prefill_pb2.PrefillResult(room=request.room, first_token_id=TOKENS[0])

    def Generate(self, request, context):
        self.seen.append(("decode", request.request_id))
        first_at = time.monotonic() + self.first_delay_s
        keepalive = self.keepalive_s and "silent" not in request.request_id
        while (left := first_at - time.monotonic()) > 0:
            time.sleep(min(left, self.keepalive_s) if keepalive else left)
            if keepalive and time.monotonic() < first_at:
                yield decode_pb2.DecodeChunk()
        yield decode_pb2.DecodeChunk(token_ids=TOKENS[:1], prompt_tokens=len(request.input_ids))
        if self.keepalive_s:
            yield decode_pb2.DecodeChunk()
        time.sleep(self.gap_s)
        yield decode_pb2.DecodeChunk(token_ids=TOKENS[1:], finish_reason="length", completion_tokens=len(TOKENS))

    def Abort(self, request, context):
        return common_pb2.AbortResponse(found=True)

    def GetLoad(self, request, context):
        return common_pb2.LoadReport()


@contextlib.contextmanager
def stub_workers(gap_s: float = 0.1, first_delay_s: float = 0.0, seen: list | None = None,
                 keepalive_s: float = 0.0):
    """Start a stub P and a stub D; yields (prefill address, decode address). ``seen`` collects
    ("prefill" | "decode", request_id) of every Prefill / Generate call."""
    servers, addrs = [], []
    try:
        for add in (prefill_pb2_grpc.add_PrefillServicer_to_server, decode_pb2_grpc.add_DecodeServicer_to_server):
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
            add(StubWorker(gap_s, first_delay_s, seen, keepalive_s), server)
            health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)  # "" is SERVING
            addrs.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            server.start()
            servers.append(server)
        yield tuple(addrs)
    finally:
        for server in servers:
            server.stop(None)
