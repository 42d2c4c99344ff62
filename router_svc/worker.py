"""One prefill or decode worker as the router sees it: address, stub, health, last load report."""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from protos import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from security import OPEN, ClusterCredentials

PREFILL = "prefill"
DECODE = "decode"


@dataclass(eq=False)
class Worker:
    """Router-side state of one worker.

    Attributes:
        worker_id: the worker's id (registry) or its address (static list).
        role: ``"prefill"`` or ``"decode"``.
        address: gRPC ``host:port``.
        healthy: the last health check answered SERVING and no call since failed with UNAVAILABLE.
        removed: the worker left the registry / the pool; never picked again.
        load: the last ``GetLoad`` report, or None before the first one.
        dispatched_since_report: requests sent here since ``load`` was taken (optimistic load).
        inflight: requests of this router currently using this worker.
        kv_signature: what its KV pool looks like (:func:`kv_signature` of the ``KVLayout`` it published
            in the registry), or None when unknown (static list): a prefill and a decode worker can
            move KV pages between them only when their signatures are equal.
        kv_page_bytes: bytes of one page over every layer's K and V (from the registry), 0 when unknown.
    """

    worker_id: str
    role: str
    address: str
    channel: grpc.aio.Channel | None = None
    stub: object = None
    healthy: bool = False
    removed: bool = False
    load: common_pb2.LoadReport | None = None
    load_time: float = 0.0
    dispatched_since_report: int = 0
    inflight: int = 0
    failures: int = 0          # health checks failed or timed out in a row
    last_error: str = ""
    kv_signature: tuple | None = None
    kv_page_bytes: int = 0

    @property
    def available(self) -> bool:
        """May a policy pick this worker?"""
        return self.healthy and not self.removed

    def load_score(self) -> float:
        """Queued + running requests from ``GetLoad``, plus requests dispatched since that report
        (requests; the unit the balance thresholds use)."""
        reported = 0
        if self.load is not None:
            reported = self.load.waiting_requests + self.load.running_requests + self.load.transferring_requests
        return float(reported + self.dispatched_since_report)

    def set_load(self, report: common_pb2.LoadReport) -> None:
        self.load = report
        self.load_time = time.monotonic()
        self.dispatched_since_report = 0

    def connect(self, credentials: ClusterCredentials = OPEN) -> None:
        """Open the aio channel (with this router's cluster credentials) and stub (call inside the
        router's event loop)."""
        if self.channel is None:
            self.channel = credentials.aio_channel(self.address, options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.enable_retries", 0),
                ("grpc.keepalive_time_ms", 10_000),
                # a restarted worker is back within seconds: do not wait out gRPC's 120 s backoff cap
                ("grpc.max_reconnect_backoff_ms", 2_000),
            ])
            stub_cls = prefill_pb2_grpc.PrefillStub if self.role == PREFILL else decode_pb2_grpc.DecodeStub
            self.stub = stub_cls(self.channel)


KV_SIGNATURE_FIELDS = ("layout", "dtype", "page_size", "num_layers", "kv_heads", "head_dim")
KV_SIGNATURE_FLAGS = {"layout": "--kv-layout", "dtype": "--dtype", "page_size": "--page-size",
                      "num_layers": "--model", "kv_heads": "--model", "head_dim": "--model"}


def kv_signature(kv_layout) -> tuple | None:
    """The fields of a ``registry_pb2.KVLayout`` two pools must share for byte-for-byte page copies
    (:data:`KV_SIGNATURE_FIELDS`), or None for an empty layout (a worker that published none)."""
    if not kv_layout.layout:
        return None
    return tuple(getattr(kv_layout, f) for f in KV_SIGNATURE_FIELDS)


def kv_page_bytes(kv_layout) -> int:
    """Bytes of one whole page (every layer's K and V) of a ``registry_pb2.KVLayout``."""
    return 2 * kv_layout.num_layers * kv_layout.page_bytes if kv_layout.layout == "layer_major" \
        else kv_layout.page_stride_bytes


def kv_compatible(a: Worker, b: Worker) -> bool:
    """True unless both workers' KV signatures are known and differ."""
    return a.kv_signature is None or b.kv_signature is None or a.kv_signature == b.kv_signature


def kv_mismatch(a: Worker, b: Worker) -> str:
    """'--kv-layout page_major vs layer_major, ...' for two workers whose signatures differ."""
    parts = []
    for f, x, y in zip(KV_SIGNATURE_FIELDS, a.kv_signature or (), b.kv_signature or ()):
        if x != y:
            parts.append(f"{f} {x} vs {y} ({KV_SIGNATURE_FLAGS[f]})")
    return ", ".join(parts)

