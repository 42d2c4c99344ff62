"""The running ``halfmoon up`` stack: start the registry, the workers and the router as child
processes (halfmoon/child_process.py), wait until all are ready and the router sees every worker,
and stop them in order (router, workers, registry). Ports and devices: :mod:`halfmoon.launcher`.
"""

from __future__ import annotations

import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import grpc

from halfmoon.child_process import Proc
from halfmoon.core_sharing import share_file, worker_env
from halfmoon.stack_config import StackConfig
from halfmoon.worker_plan import context_args, plan_workers, worker_argv
from halfmoon.stack_credentials import AuthMode, StackCredentials, prepare

_REGISTRY_RE = re.compile(r"registry listening grpc=(\S+) metrics=(\S+)")
_WORKER_RE = re.compile(r"READY (\S+) grpc=(\S+)(?: metrics=(\S*))?")
_ROUTER_RE = re.compile(r"READY router grpc=(\S+) http=(\S+) metrics=(\S+)")


class StackError(RuntimeError):
    """A process of the stack failed to start or died."""


class Stack:
    """The running stack; use as a context manager (``with Stack(cfg) as s: s.endpoints``).

    Raises:
        StackError: from :meth:`start` when a process exits or is not ready in time (with its log tail).
    """

    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="halfmoon-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []
        self.endpoints: dict = {}
        self.credentials: StackCredentials | None = None
        self.etcd = None  # LocalEtcd with registry="etcd"

    def _port(self, offset: int) -> int:
        return 0 if self.cfg.base_port == 0 else self.cfg.base_port + offset

    def __enter__(self) -> "Stack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait(self, procs: list[Proc], deadline: float) -> None:
        while not all(p.poll_ready() for p in procs):
            for p in procs:
                if not p.alive() and not p.poll_ready():
                    raise StackError(f"{p.name} exited (rc={p.popen.returncode}) before it was ready; "
                                     f"log {p.log}:\n{p.tail()}")
            if time.monotonic() > deadline:
                late = [p.name for p in procs if not p.poll_ready()]
                raise StackError(f"not ready after {self.cfg.ready_timeout:.0f} s: {late}; logs in {self.log_dir}")
            time.sleep(0.1)

    def start(self) -> dict:
        """Start every process, wait until all are healthy; returns :attr:`endpoints`."""
        c = self.cfg
        deadline = time.monotonic() + c.ready_timeout
        n = c.prefill + c.decode
        plan = plan_workers(c)
        threads = plan[0].threads
        names = ["registry", "router"] + [f"prefill-{i}" for i in range(c.prefill)] + \
            [f"decode-{i}" for i in range(c.decode)]
        try:
            creds = self.credentials = prepare(AuthMode(c.auth), self.log_dir, names, tls_dir=c.tls_dir,
                                               hosts=(c.host,))
        except ValueError as e:
            raise StackError(str(e)) from None
        backend = []
        if c.registry == "etcd":
            from halfmoon.etcd_local import LocalEtcd
            self.etcd = LocalEtcd(self.log_dir / "etcd-data", log=self.log_dir / "etcd.log")
            backend = ["--registry-backend", "etcd", "--etcd-endpoints", self.etcd.endpoint]
        reg = Proc("registry", ["serve-transfer", "--host", c.host, "--port", str(self._port(3)),
                                "--metrics-port", str(self._port(4)), *backend, *creds.process_args("registry")],
                   self.log_dir / "registry.log",
                   _REGISTRY_RE, extra_env={"OMP_NUM_THREADS": "1"})
        self.procs.append(reg)
        reg.start()
        self._wait([reg], deadline)
        registry = reg.match.group(1)
        workers = []
        share = share_file(c, plan, self.log_dir)
        for w in plan:
            wid, role = w.worker_id, w.role
            argv = worker_argv(c, w, (self._port(10 + 2 * w.k), self._port(11 + 2 * w.k)), registry,
                               creds.process_args(wid))
            if share is not None:
                argv += ["--cpu-share", str(share)]
            p = Proc(wid, argv, self.log_dir / f"{wid}.log", _WORKER_RE, extra_env=worker_env(c, w))
            self.procs.append(p)
            workers.append((role, p))
            p.start()
        router = Proc("router", ["serve-router", "--model", c.model, "--host", c.host, "--port", str(self._port(0)),
                                 "--http-port", str(self._port(1)), "--metrics-port", str(self._port(2)),
                                 "--registry", registry, *self._policy_args(), "--page-size", str(c.page_size),
                                 *creds.process_args("router"), *creds.router_args(), *context_args(c),
                                 *c.router_args],
                      self.log_dir / "router.log", _ROUTER_RE, extra_env={"OMP_NUM_THREADS": "1"})
        self.procs.append(router)
        router.start()
        self._wait([p for _, p in workers] + [router], deadline)
        rg, rh, rm = router.match.groups()
        self.endpoints = {
            "router": {"grpc": rg, "http": rh, "metrics": rm, "pid": router.popen.pid},
            "registry": {"grpc": registry, "metrics": f"{c.host}:{reg.match.group(2)}", "pid": reg.popen.pid},
            "prefill": [], "decode": [], "model": c.model, "log_dir": str(self.log_dir),
            "torch_threads": threads, "cpu_share": str(share or ""), **creds.endpoints_fields(),
        }
        for role, p in workers:
            wid, addr, metrics = p.match.groups()
            self.endpoints[role].append({"worker_id": wid, "grpc": addr, "metrics": metrics or "",
                                         "pid": p.popen.pid})
        self._wait_router_sees_workers(rg, n, deadline)
        return self.endpoints

    def _policy_args(self) -> list[str]:
        c = self.cfg
        if c.policy == "kv_events":
            return ["--policy", "kv_events"]
        return ["--prefill-policy", c.prefill_policy, "--decode-policy", c.decode_policy]

    def _wait_router_sees_workers(self, address: str, n: int, deadline: float) -> None:
        from protos import router_pb2, router_pb2_grpc

        with grpc.insecure_channel(address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            while True:
                try:
                    ws = stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5,
                                          metadata=self.credentials.router_metadata()).workers
                    if sum(1 for w in ws if w.healthy) >= n:
                        return
                except grpc.RpcError:
                    pass
                dead = [p for p in self.procs if not p.alive()]
                if dead:
                    raise StackError(f"{dead[0].name} died during start-up; log {dead[0].log}:\n{dead[0].tail()}")
                if time.monotonic() > deadline:
                    raise StackError(f"the router does not see {n} healthy workers after "
                                     f"{self.cfg.ready_timeout:.0f} s; logs in {self.log_dir}")
                time.sleep(0.2)

    def dead(self) -> list[Proc]:
        """Processes that exited on their own."""
        return [p for p in self.procs if p.popen is not None and not p.alive()]

    def stop(self) -> None:
        """Router first, then workers, then the registry: SIGTERM each group, SIGKILL stragglers."""
        order = [p for p in self.procs if p.name == "router"] + \
                [p for p in self.procs if p.name not in ("router", "registry")] + \
                [p for p in self.procs if p.name == "registry"]
        for group in (order[:1], order[1:-1], order[-1:]):
            for p in group:
                p.signal(signal.SIGTERM)
            end = time.monotonic() + self.cfg.stop_timeout
            for p in group:
                if p.popen is None:
                    continue
                try:
                    p.popen.wait(timeout=max(0.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.signal(signal.SIGKILL)
                    p.popen.wait()
                p.signal(signal.SIGKILL)  # anything its process group still holds
        if self.etcd is not None:
            self.etcd.stop()
