"""The transfer benchmark's worker processes: a target or an initiator of one engine, answering
the controller's JSON-line commands on stdout, and ``Proc``, the controller's handle on one.

Commands (one JSON object a line on stdin, one reply a line): target: cpu (its process CPU seconds),
sha256 of a range of its buffer, zero, exit; initiator: load (prepare a named workload's
descriptors), run (one batch: wall and CPU seconds to remote completion), exit."""

from __future__ import annotations

import hashlib
import json
import os
import select
import subprocess
import sys
import time

import numpy as np

from bench.transfer_peers import ROOT, close, open_initiator, open_target
from bench.transfer_workloads import REGION, fill

_OUT = sys.stdout  # replaced in worker processes by a private copy of fd 1


def private_stdout() -> None:
    """Workers answer on a dup of fd 1 and point fd 1 at stderr: libraries (NIXL, Mooncake) print."""
    global _OUT
    _OUT = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)


def _reply(obj) -> None:
    _OUT.write(json.dumps(obj) + "\n")
    _OUT.flush()


def run_target(engine: str) -> None:
    buf = np.zeros(REGION, dtype=np.uint8)
    keep, info = open_target(engine, buf.ctypes.data, REGION)
    _reply(info)
    for line in sys.stdin:
        c = json.loads(line)
        if c["cmd"] == "cpu":
            _reply({"cpu": time.process_time()})
        elif c["cmd"] == "sha256":
            _reply({"sha256": hashlib.sha256(buf[c["offset"]:c["offset"] + c["length"]]).hexdigest()})
        elif c["cmd"] == "zero":
            buf[:] = 0
            _reply({"ok": True})
        elif c["cmd"] == "exit":
            break
    close(engine, keep)


def run_initiator(engine: str, target: dict) -> None:
    src = np.zeros(REGION, dtype=np.uint8)
    fill(src, 1)
    eng, prepare, run = open_initiator(engine, target, src.ctypes.data, REGION)
    prepared = {}
    _reply({"ready": True})
    for line in sys.stdin:
        c = json.loads(line)
        if c["cmd"] == "load":
            prepared[c["name"]] = prepare([tuple(x) for x in c["descs"]])
            _reply({"ok": True})
        elif c["cmd"] == "run":
            p = prepared[c["name"]]
            c0 = time.process_time()
            t0 = time.perf_counter()
            run(p)
            t1 = time.perf_counter()
            _reply({"seconds": t1 - t0, "cpu": time.process_time() - c0})
        elif c["cmd"] == "exit":
            break
    close(engine, eng)


class Proc:
    """A worker process (``python -m <module> <args>``, by default ``bench.transfer --worker ...``)
    and its command pipe."""

    def __init__(self, args: list[str], env: dict[str, str], module: str = "bench.transfer"):
        full_env = dict(os.environ, OMP_NUM_THREADS="1", **env)
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        self.p = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=full_env)

    def read(self, timeout=120.0) -> dict:
        r, _, _ = select.select([self.p.stdout], [], [], timeout)
        line = self.p.stdout.readline() if r else ""
        if not line:
            raise RuntimeError(f"worker {self.p.args[3:6]} gave no reply (rc={self.p.poll()})")
        return json.loads(line)

    def ask(self, obj: dict, timeout=120.0) -> dict:
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()
        return self.read(timeout)

    def close(self) -> None:
        try:
            self.p.stdin.write('{"cmd": "exit"}\n')
            self.p.stdin.flush()
            self.p.wait(timeout=10)
        except Exception:  # noqa: BLE001
            self.p.kill()
            self.p.wait()
