"""Shared fixtures for integration tests: real processes (registry, prefill, decode) on loopback.

Processes are started with ``python -m halfmoon <subcommand>``, one torch thread each, and stopped
by PID (SIGTERM, then SIGKILL). Each worker logs to a file under the test's tmp dir; the READY line
(``READY <worker-id> grpc=<addr> ...``) tells when it serves.

    with start_stack(tmp_path, page_size=16) as st:      # registry + 1 P + 1 D
        drv = PDDriver(st.prefill_addr, st.decode_addr)
        ...
        assert_idle_accounting(st)

``pd_stack`` is a module-scoped stack with the defaults; the router tests reuse ``start_stack``,
``start_registry`` and ``start_worker``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = os.environ.get("HALFMOON_TEST_MODEL", "smollm2-135m-instruct")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_available(model: str = MODEL) -> bool:
    from engine.model_store import ModelNotFoundError, resolve_model

    try:
        resolve_model(model)
        return True
    except ModelNotFoundError:
        return False


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    address: str = ""
    metrics_address: str = ""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_line(self, pattern: str, timeout: float = 180.0) -> re.Match:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = rx.search(self.log())
            if m:
                return m
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.popen.returncode}):\n{self.log()[-4000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{self.name}: no line matching {pattern!r} in {timeout} s:\n{self.log()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)

    def kill(self) -> None:
        """SIGKILL (a crash): no cleanup runs in the process."""
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)


def _env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _spawn(name: str, args: list[str], log_dir: Path) -> Proc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    f = open(log_path, "ab")
    popen = subprocess.Popen([sys.executable, "-m", "halfmoon", *args], cwd=ROOT, env=_env(),
                             stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    f.close()
    return Proc(name, popen, log_path)


def start_registry(log_dir: Path, ttl: int = 5) -> Proc:
    port = free_port()
    p = _spawn("registry", ["serve-transfer", "--port", str(port), "--metrics-port", "-1",
                            "--ttl", str(ttl)], log_dir)
    p.wait_line(r"registry listening grpc=(\S+)", timeout=60)
    p.address = f"127.0.0.1:{port}"
    return p


def start_router(log_dir: Path, *, registry: str = "", prefill: list[str] = (), decode: list[str] = (),
                 model: str = MODEL, extra: list[str] = ()) -> Proc:
    """Start ``halfmoon serve-router`` on free ports, with workers from ``registry`` or static
    ``prefill`` / ``decode`` addresses; ``address`` is its gRPC address."""
    args = ["serve-router", "--model", model, "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
            "--metrics-port", "0", "--health-interval", "0.2"]
    args += ["--registry", registry] if registry else ["--prefill", ",".join(prefill), "--decode", ",".join(decode)]
    p = _spawn("router", args + list(extra), log_dir)
    p.address = p.wait_line(r"READY router grpc=(\S+)", timeout=120).group(1)
    return p


def wait_router_sees(router: Proc, n: int, timeout: float = 60.0, api_key: str = "") -> None:
    """Wait until ``router`` lists ``n`` healthy workers (``api_key``: sent as the bearer token)."""
    from protos import router_pb2, router_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(router.address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        md = [("authorization", f"Bearer {api_key}")] if api_key else None
        while sum(w.healthy for w in stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10,
                                                      metadata=md).workers) < n:
            assert time.monotonic() < deadline, f"router does not see {n} healthy workers:\n{router.log()[-4000:]}"
            time.sleep(0.1)


def assert_clean_log(proc: Proc) -> None:
    """No traceback and no ERROR line in ``proc``'s log."""
    text = proc.log()
    bad = [line for line in text.splitlines() if "Traceback" in line or re.search(r"\bERROR\b", line)]
    assert not bad, f"{proc.name} logged errors:\n{text[-6000:]}"


def start_worker(role: str, registry: str, log_dir: Path, worker_id: str, *, model: str = MODEL,
                 page_size: int = 16, num_pages: int | None = None, kv_memory_mb: float = 64,
                 extra: list[str] = (), wait: bool = True) -> Proc:
    """Start ``halfmoon serve-prefill|serve-decode`` (role "prefill" | "decode")."""
    args = [f"serve-{role}", "--model", model, "--host", "127.0.0.1", "--port", "0",
            "--metrics-port", "0", "--registry", registry, "--worker-id", worker_id,
            "--page-size", str(page_size), "--torch-threads", "1", "--transport", "sm",
            "--max-running-requests", "16"]
    args += ["--num-pages", str(num_pages)] if num_pages else ["--kv-memory-mb", str(kv_memory_mb)]
    p = _spawn(worker_id, args + list(extra), log_dir)
    if wait:
        wait_ready(p)
    return p


def wait_ready(p: Proc, timeout: float = 240.0) -> None:
    m = p.wait_line(r"READY (\S+) grpc=(\S+) metrics=(\S*)", timeout=timeout)
    p.address, p.metrics_address = m.group(2), m.group(3)


@dataclass
class Stack:
    registry: Proc
    prefill: Proc
    decode: Proc
    log_dir: Path
    transfer_log: Path
    page_size: int
    procs: list = field(default_factory=list)
    decodes: dict = field(default_factory=dict)  # worker id -> Proc (decode is the first)

    @property
    def prefill_addr(self) -> str:
        return self.prefill.address

    @property
    def decode_addr(self) -> str:
        return self.decode.address

    def transfer_records(self) -> list[dict]:
        """P's transfer log (one dict per batch / notice), in order."""
        if not self.transfer_log.exists():
            return []
        return [json.loads(line) for line in self.transfer_log.read_text().splitlines() if line.strip()]


@contextlib.contextmanager
def start_stack(log_dir: Path, *, page_size: int = 16, prefill_pages: int | None = None,
                decode_pages: int | None = None, prefill_extra: list[str] = (),
                decode_extra: list[str] = (), model: str = MODEL, kv_memory_mb: float = 64,
                more_decodes: dict[str, list[str]] | None = None):
    """Registry + one prefill ("prefill-0") + decode "decode-0" (+ ``more_decodes``: worker id ->
    extra flags), all started concurrently; stopped on exit."""
    log_dir = Path(log_dir)
    tlog = log_dir / "transfer.jsonl"
    reg = start_registry(log_dir)
    procs = [reg]
    try:
        p = start_worker("prefill", reg.address, log_dir, "prefill-0", model=model,
                         page_size=page_size, num_pages=prefill_pages, kv_memory_mb=kv_memory_mb,
                         extra=["--transfer-log", str(tlog), *prefill_extra], wait=False)
        procs.append(p)
        decodes = {}
        for wid, extra in {"decode-0": list(decode_extra), **(more_decodes or {})}.items():
            decodes[wid] = start_worker("decode", reg.address, log_dir, wid, model=model,
                                        page_size=page_size, num_pages=decode_pages,
                                        kv_memory_mb=kv_memory_mb, extra=extra, wait=False)
            procs.append(decodes[wid])
        for proc in procs[1:]:
            wait_ready(proc)
        yield Stack(reg, p, decodes["decode-0"], log_dir, tlog, page_size, procs, decodes)
    finally:
        for proc in reversed(procs):
            proc.stop()


def get_load(address: str, service: str, credentials=None, per_rank: bool = False):
    """``GetLoad`` of the worker at ``address`` (``credentials``: a security.ClusterCredentials, for a
    stack with a cluster token or mTLS; None: an open one; ``per_rank``: with every TP rank's entry)."""
    from protos import decode_pb2_grpc, prefill_pb2_grpc, common_pb2
    from security import OPEN

    with (credentials or OPEN).channel(address) as ch:
        stub = (prefill_pb2_grpc.PrefillStub if service == "prefill" else decode_pb2_grpc.DecodeStub)(ch)
        return stub.GetLoad(common_pb2.GetLoadRequest(per_rank=per_rank), timeout=30)


def assert_idle_accounting(stack_or_addrs, timeout: float = 30.0, credentials=None) -> dict:
    """Wait until P and D are idle, then assert free + evictable + locked + owned == pool, no lock,
    room or request slot held, and every tensor-parallel rank agrees with rank 0. Returns
    {"prefill": KVAccounting, "decode": KVAccounting}."""
    from pd_common.rank_accounting import disagreements

    if isinstance(stack_or_addrs, Stack):
        targets = [("prefill", stack_or_addrs.prefill_addr)]
        targets += [("decode", d.address) for d in stack_or_addrs.decodes.values()
                    if d.popen.poll() is None]
    else:
        targets = list(stack_or_addrs)
    out = {}
    for service, addr in targets:
        deadline = time.monotonic() + timeout
        while True:
            a = get_load(addr, service, credentials).accounting
            idle = a.held_rooms == 0 and a.held_req_slots == 0 and a.owned_pages == 0 and a.locked_pages == 0
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert a.free_pages + a.evictable_pages + a.locked_pages + a.owned_pages == a.total_pages, (service, a)
        assert a.locked_pages == 0 and a.min_lock_ref == 0, (service, a)
        assert a.owned_pages == 0, (service, a)
        assert a.held_rooms == 0 and a.held_req_slots == 0, (service, a)
        # every tensor-parallel rank: its pool holds the pages rank 0 places, and it ran the same
        # forwards over the same page-table rows (pd_common/rank_accounting.py)
        ranks = get_load(addr, service, credentials, per_rank=True).ranks
        assert [r.rank for r in ranks] == list(range(len(ranks))) and ranks, (service, ranks)
        assert ranks[0].pool_pages == a.total_pages, (service, ranks[0], a)
        assert not disagreements(ranks), (service, disagreements(ranks))
        out[service] = a
    return out


@pytest.fixture(scope="module")
def pd_stack(tmp_path_factory):
    if not model_available():
        pytest.skip(f"model {MODEL} is not pulled (run `halfmoon models pull {MODEL}`)")
    with start_stack(tmp_path_factory.mktemp("pd")) as st:
        yield st
