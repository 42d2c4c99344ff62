"""Worker runtime shared by the two halves of a PD pair (``serve-prefill`` and ``serve-decode``).

Start-up order: model + KV pool (ModelRunner) -> transfer engine with every K/V buffer registered
-> gRPC server (service + grpc.health.v1 NOT_SERVING + reflection) -> ``/metrics`` -> publish the
segment (KVLayout: the pool's ``--kv-layout``) and the worker record in the registry (heartbeats)
-> health SERVING -> one line ``READY <worker-id> grpc=<addr>`` on stdout. SIGTERM/SIGINT drain it
(pd_common/drain.py: NOT_SERVING, no new request, ``--drain-grace-s`` for running calls, the rest
handed back to the router) and stop it in reverse. A ``--device`` this process cannot use stops it first with one ``error:`` line.

With ``--tp N`` the runner starts ranks 1..N-1 (``pd_common/tp_rank.py``), each with its own
transfer engine and KV shard; the worker publishes ONE segment descriptor with every rank's region
(transfer_svc/rank_regions.py). A rank that dies stops the worker (it deregisters; exit code 1).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading

from grpc_health.v1 import health_pb2

from engine.attention import BACKENDS
from engine.device import check_device, device_spec
from engine.engine_args import int_at_least, non_negative_float
from pd_common.cpu_share import add_cpu_share_argument, open_cpu_share
from pd_common.tp_flags import check_tp_flags
from security import ClusterCredentials, CredentialsError
from security.flags import add_cluster_auth_args
from telemetry import metrics as M

log = logging.getLogger("halfmoon.worker")


def add_common_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    """Flags both workers take (the router and launcher engineers use exactly these)."""
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name or HF directory")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: random weights (--model: a shape name, or a dir with config.json)")
    parser.add_argument("--host", default="127.0.0.1", help="gRPC bind address")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0 = pick a free one)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="Prometheus /metrics port (0 = pick a free one, -1 = none)")
    parser.add_argument("--registry", default="127.0.0.1:50050", help="transfer registry host:port")
    parser.add_argument("--advertise-host", default=None,
                        help="host peers use to reach this worker (default: --host)")
    parser.add_argument("--worker-id", default=f"{role}-{socket.gethostname()}-{os.getpid()}",
                        help="worker id = transfer segment name")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--kv-layout", default="page_major", choices=["page_major", "layer_major"],
                        help="KV pool layout (P and D must match): page_major = one transfer put per "
                             "page run | layer_major = one per run per layer per K/V")
    parser.add_argument("--attention-backend", default="auto", choices=BACKENDS,
                        help="auto: flashinfer on CUDA bf16/fp16, cpu_paged on CPU once `make kernels` "
                             "built it (else torch_paged, logged) | torch | torch_paged | cpu_paged | flashinfer")
    parser.add_argument("--kv-memory-mb", type=float, default=512.0, help="KV pool budget in MiB")
    parser.add_argument("--num-pages", type=int, default=None, help="KV pages (overrides --kv-memory-mb)")
    parser.add_argument("--torch-threads", type=int, default=1, help="intra-op torch threads")
    parser.add_argument("--max-running-requests", type=int, default=32,
                        help="prefill: requests held at once (req_to_token rows); decode: requests "
                             "decoding at once, plus as many more pre-allocated / waiting for KV")
    parser.add_argument("--max-context", type=int_at_least(1), default=None,
                        help="tokens per request, prompt + output (default: the model's window); at "
                             "most the model's window. The router refuses to pair with a worker whose "
                             "cap is below its own serve-router --max-context")
    parser.add_argument("--chunked-prefill-size", type=int, default=512,
                        help="max prompt tokens per prefill forward (bounds how long one step blocks)")
    parser.add_argument("--transport", default="auto",
                        help="UCX transports: auto (sm on CPU; on CUDA UCX's own choice, which takes "
                             "cuda_ipc between GPUs of one host) | all (UCX's own choice) | sm | tcp | "
                             "a UCX_TLS list")
    parser.add_argument("--transfer-timeout", type=float, default=30.0,
                        help="seconds before a pending KV transfer batch fails")
    parser.add_argument("--kv-checksums", action="store_true",
                        help="P sends crc32 checksums per (page, kv head) in the notice; D verifies them on "
                             "every rank, and re-verifies cached pages a prefix hit reuses")
    # role-specific knobs, accepted by both commands so one flag set can start either role
    parser.add_argument("--destination-timeout", type=float, default=120.0,
                        help="[prefill] seconds a request waits for D's KV destination (and an early "
                             "destination waits for its request) before it fails; a Prefill call with "
                             "a deadline waits until its deadline instead (D may queue it under memory "
                             "pressure)")
    parser.add_argument("--grpc-threads", type=int_at_least(8), default=1024,
                        help="gRPC server threads: every open Prefill call (prefill), Generate stream "
                             "(decode with --stream-server threads; with aio, the default, streams take "
                             "none) and KVEvents subscription holds one until it ends, so this bounds "
                             "concurrent requests; health checks and GetLoad need free ones too. Threads "
                             "start on demand")
    parser.add_argument("--kv-wait-timeout", type=float, default=180.0,
                        help="[decode] seconds a pre-allocated request waits for P's KV and notice")
    parser.add_argument("--kv-write-window", type=float, default=120.0,
                        help="[decode] seconds after receiving a KV destination during which P may start "
                             "writing it (sent to P, which refuses writes after it)")
    parser.add_argument("--fence-margin", type=float, default=30.0,
                        help="[decode] seconds added to SetDestination's deadline + --kv-write-window before "
                             "quarantined pages of a silent P are reused; must cover the longest write in "
                             "flight (docs/architecture.md, Fencing one-sided writes)")
    parser.add_argument("--fence-timeout", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--lease-fence-margin", type=float, default=2.0,
                        help="[prefill] start no KV write while our registry lease has less than this many "
                             "seconds left by our own clock (keep it below 2/3 of --lease-ttl)")
    parser.add_argument("--lease-ttl", type=int, default=10,
                        help="registry lease TTL this worker asks for, seconds (heartbeats every TTL/3)")
    parser.add_argument("--disable-decode-radix-cache", action="store_true",
                        help="[decode] no prefix cache on decode: every prompt page is transferred")
    parser.add_argument("--disable-radix-cache", action="store_true",
                        help="[prefill] no prefix cache on the prefill worker")
    parser.add_argument("--transfer-log", default=None,
                        help="[prefill] append one JSON line per KV batch and notice to this file")
    parser.add_argument("--device", default="cpu", type=device_spec, help="cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="weights and KV dtype (P and D must match; pass bfloat16 on GPUs, float32 is "
                             "the CPU reference)")
    parser.add_argument("--drain-grace-s", type=non_negative_float, default=20.0,
                        help="on SIGTERM: seconds running requests get to finish (the worker turns "
                             "NOT_SERVING and takes no new request); then a decode worker hands the rest "
                             "back to the router, which migrates them to another pair. Keep it a few "
                             "seconds below the pod's terminationGracePeriodSeconds")
    parser.add_argument("--log-level", default="INFO", help="DEBUG | INFO | WARNING | ERROR")
    parser.add_argument("--tp", type=int_at_least(1), default=1,
                        help="tensor-parallel ranks of this worker (one process each; on CUDA rank r "
                             "uses --device's index + r); page_major KV layout only")
    parser.add_argument("--tp-timeout", type=non_negative_float, default=30.0,
                        help="seconds any tensor-parallel collective may take before the worker stops")
    add_cluster_auth_args(parser)
    add_cpu_share_argument(parser)


def load_credentials(args) -> ClusterCredentials:
    """This process's cluster credentials from its flags and env.

    Raises:
        SystemExit: one ``error:`` line naming the flag and file (no traceback).
    """
    try:
        return ClusterCredentials.from_args(args)
    except CredentialsError as e:
        raise SystemExit(f"error: {e}") from None


def ucx_transports(spec: str, device: str) -> str | None:
    """UCX_TLS for the transfer engine from ``--transport`` (None = UCX picks among all transports).

    "auto": "sm" for a CPU pool (shared memory between the processes of one host); None for a CUDA
    pool, so that UCX can use cuda_copy / cuda_ipc for GPU memory (the setting bench/gpu_transfer.py
    measured GPU -> GPU over cuda_ipc with). "all": None on any device.
    """
    if spec == "all" or (spec == "auto" and device.startswith("cuda")):
        return None
    return "sm" if spec == "auto" else spec


def bind_cuda_device(device) -> None:
    """Make ``device`` the calling thread's current CUDA device (a no-op for CPU). CUDA's current
    device is per thread and starts at 0: CUDA-graph capture streams, ``torch.cuda.current_stream()``
    and kernels launched without a device guard follow it, so a worker on cuda:1 sets it in the main
    thread (model load, graph capture) and in its scheduler thread (forwards, graph replay)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)


def check_max_context(args) -> None:
    """Refuse a ``--max-context`` above the model's window before anything loads.

    Raises:
        SystemExit: one ``error:`` line naming the flag and the window. An unknown model is left to
            the loader, which names it.
    """
    from engine.config import served_context
    from engine.errors import InvalidRequestError
    from engine.models.model_loader import resolve_model_config

    if args.max_context is None:
        return
    try:
        cfg, _ = resolve_model_config(args.model, args.load_format)
    except InvalidRequestError:
        return
    try:
        served_context(args.max_context, cfg.max_position_embeddings)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def engine_config(args, rows: int, disable_radix_cache: bool = False):
    from engine.config import EngineConfig

    return EngineConfig(model=args.model, load_format=args.load_format, device=args.device,
                        dtype=args.dtype,
                        page_size=args.page_size, kv_memory=int(args.kv_memory_mb * (1 << 20)),
                        num_pages=args.num_pages, max_running_requests=rows,
                        max_context=args.max_context, chunked_prefill_size=args.chunked_prefill_size,
                        disable_radix_cache=disable_radix_cache, torch_threads=args.torch_threads,
                        kv_layout=args.kv_layout, tp_size=args.tp, tp_timeout_s=args.tp_timeout,
                        attention_backend=args.attention_backend)


class Worker:
    """The process-level parts of one worker; the service plugs in through ``add_service``."""

    def __init__(self, args, role: str):
        logging.basicConfig(level=args.log_level.upper(),
                            format=f"%(asctime)s %(levelname)s {args.worker_id} %(name)s: %(message)s")
        os.environ.setdefault("OMP_NUM_THREADS", str(args.torch_threads))
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: thread dump
        self.credentials = load_credentials(args)
        why = check_tp_flags(args)
        if why:
            raise SystemExit(f"error: {why}")
        check_device(args.device)
        check_max_context(args)
        self.cpu_share = open_cpu_share(args, role)  # a bad --cpu-share stops us before the model loads
        bind_cuda_device(args.device)  # before the model loads and CUDA graphs are captured
        self.args = args
        self.role = role
        self.worker_id = args.worker_id
        self.registry = None
        self.transfer = None
        self.server = None
        self.kv_events = None  # KVEventPublisher, served next to the service when set
        self.health = None
        self.grpc_address = ""
        self.metrics_address = ""
        self.rank_descriptors = []  # ranks 1..N-1's segment descriptors (tensor parallelism)
        self.rank_regions = []      # every rank's KV region, rank order
        self.fatal: str | None = None  # why the worker stops by itself (a tensor-parallel rank died)
        self._stop = threading.Event()

    def follower_spec(self):
        """The program ranks 1..N-1 run (``ModelRunner(..., follower=)``): the rank's transfer engine
        with the worker's transport settings."""
        import dataclasses
        import json

        from engine.distributed.group import FollowerSpec
        from pd_common.tp_rank import AgentConfig

        a = self.args
        cfg = AgentConfig(self.worker_id, ucx_transports(a.transport, a.device), a.transfer_timeout,
                          busy_poll=a.device.startswith("cuda"),
                          staging_bytes=int(getattr(a, "kv_staging_mb", 0) * (1 << 20)))
        return FollowerSpec("pd_common.tp_rank", json.dumps(dataclasses.asdict(cfg)))

    def start_transfer(self, runner):
        """Transfer engine named after the worker, every K/V buffer registered, plus the registry
        client used as its resolver."""
        from pd_common.protocol import published_layout
        from transfer_svc.engine import TransferEngine
        from transfer_svc.registry_client import RegistryClient

        a = self.args
        self.registry = RegistryClient(a.registry, worker_id=self.worker_id, role=self.role,
                                       model=a.model, ttl_s=a.lease_ttl, credentials=self.credentials)
        loc = "cpu" if runner.device.type == "cpu" else f"cuda:{runner.device.index or 0}"
        # GPU workers poll UCX without sleeping while a batch is in flight: +12-15 % GPU->GPU KV
        # throughput on an H200 pair (bench/results/GPU_NOTES.md run 7); CPU workers on small shared
        # boxes sleep (a spinning thread takes a core from the peer)
        self.transfer = TransferEngine(self.worker_id, transports=ucx_transports(a.transport, loc),
                                       timeout_s=a.transfer_timeout, resolver=self.registry,
                                       busy_poll=runner.device.type == "cuda")
        for buf in runner.kv_pool.buffers():
            self.transfer.register_memory(buf.data_ptr(), buf.numel() * buf.element_size(), loc)
        self.layout = published_layout(runner, a.model)
        self._collect_ranks(runner)
        graphs = runner.graph_runner.buckets if runner.graph_runner is not None else "off"
        log.info("engine: device=%s dtype=%s attention=%s cuda_graphs=%s kv_pages=%d ucx_tls=%s",
                 loc, str(runner.dtype).removeprefix("torch."), type(runner.backend).__name__, graphs,
                 runner.allocator.num_pages, ucx_transports(a.transport, loc) or "(UCX's choice)")
        return self.transfer

    def _collect_ranks(self, runner) -> None:
        """Every rank's region and descriptor (``rank_collection``); the rank-death hook that stops
        this worker."""
        from pd_common.rank_collection import collect_ranks

        if runner.tp is not None:
            runner.tp.on_rank_death = self._rank_died
        ranks = collect_ranks(runner)
        self.rank_regions, self.rank_descriptors = ranks.regions, ranks.descriptors

    def _rank_died(self, reason: str) -> None:
        log.error("%s: stopping this worker", reason)
        self.fatal = reason
        self._stop.set()

    def attach_kv_events(self, sched) -> None:
        """Publish ``sched``'s radix cache events on ``halfmoon.v1.KVEvents`` (call after
        ``start_transfer``, before the scheduler starts)."""
        from pd_common.kv_events import KVEventPublisher

        self.kv_events = KVEventPublisher(self.worker_id, self.args.page_size)
        self.kv_events.incarnation = self.transfer.incarnation
        sched.kv_events = self.kv_events

    def start_server(self, add_service, service_name: str, aio: bool = False) -> None:
        """Serve ``service_name`` (+ KVEvents, health, reflection). ``aio``: a ``grpc.aio`` server on
        its own loop thread (pd_common/aio_server.py), for a service with coroutine handlers
        (``pd_common/grpc_server.py``). Raises OSError when the address cannot be bound."""
        from pd_common.grpc_server import start_grpc_server

        a = self.args
        served = start_grpc_server(add_service, service_name, host=a.host, port=a.port, threads=a.grpc_threads,
                                   role=self.role, credentials=self.credentials, kv_events=self.kv_events, aio=aio)
        self.server, self.health, port = served.server, served.health, served.port
        log.info("cluster identity: %s", self.credentials.mode)
        self.service_name = service_name
        self.grpc_address = f"{a.advertise_host or a.host}:{port}"
        if a.metrics_port >= 0:
            mport = M.start_metrics_server(a.metrics_port, role=self.role, worker_id=self.worker_id,
                                           model=a.model)
            self.metrics_address = f"{a.advertise_host or a.host}:{mport}"

    def publish_and_serve(self) -> None:
        """Publish segment + record, flip health to SERVING, print the READY line."""
        rec = self.registry.record
        rec.grpc_address = self.grpc_address
        rec.metrics_address = self.metrics_address
        desc = self.transfer.publish(self.layout)
        if self.rank_descriptors:
            from transfer_svc.rank_regions import tp_descriptor

            desc = tp_descriptor(desc, [(r.head_start, r.head_end) for r in self.rank_regions],
                                 self.rank_descriptors)
        self.registry.publish(desc)
        for name in ("", self.service_name):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        print(f"READY {self.worker_id} grpc={self.grpc_address} metrics={self.metrics_address}",
              flush=True)

    def wait_for_signal(self) -> None:
        """Until SIGINT / SIGTERM, or a tensor-parallel rank died (``fatal``)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self._stop.set())
        self._stop.wait()

    def drain(self, drain, hand_back=None) -> None:
        """The graceful part of a SIGTERM (pd_common/drain.py): NOT_SERVING, no new request; calls
        that sent nothing yet are handed back at once (``hand_back(unsent_only=True)``: the router
        retries them elsewhere), running ones get ``drain.grace_s``, then the rest are handed back
        (``hand_back(False)``; without one, :meth:`shutdown` answers them UNAVAILABLE). A second
        signal cuts the grace short."""
        self._not_serving()
        drain.begin()
        if self.fatal is not None:  # nothing can run any more: no grace, the router retries elsewhere
            drain.hurry.set()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: drain.hurry.set())
        log.info("draining: %d running calls get up to %g s (--drain-grace-s)", drain.active, drain.grace_s)
        if hand_back is not None:
            hand_back(True)
        left = drain.wait_idle(drain.grace_s)
        if left and hand_back is not None:
            log.info("drain grace over: %d streams handed back to the router to migrate", hand_back(False))
            left = drain.wait_idle(5.0)
        log.info("drained (%d calls still running); stopping", left)

    def _not_serving(self) -> None:
        if self.health is not None:
            for name in ("", self.service_name):
                self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def shutdown(self, stop_service=None) -> None:
        self._not_serving()
        if self.registry is not None:
            self.registry.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.server is not None:
            stopped = self.server.stop(grace=1.0)
            if stopped is not None:  # grpc.server's: an event; LoopServer.stop blocks
                stopped.wait()
        if stop_service is not None:
            stop_service()
        if self.transfer is not None:
            self.transfer.close()
        self.cpu_share.close()
        M.stop_metrics_servers()


def fail_start(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    return 2
