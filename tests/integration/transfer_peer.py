"""A standalone transfer-engine peer process for the transfer tests, driven by JSON lines on stdin.

    python -m tests.integration.transfer_peer --name b --transports tcp --size 134217728
                                              [--fill-seed 3] [--device cuda:0]

Registers one host buffer of `--size` bytes, prints `{"descriptor": <base64 SegmentDescriptor>,
"base": <addr>}`, then answers one JSON line per command:

    {"cmd": "sha256", "offset": o, "length": n}              -> {"sha256": hex}
    {"cmd": "fill", "seed": s}                                -> {"ok": true}   (deterministic bytes)
    {"cmd": "open", "descriptor": b64}                        -> {"name": ...}
    {"cmd": "submit", "segment": name, "descs": [[lo, ro, n], ...], "op": "WRITE"|"READ",
     "wait": bool, "notify": b64 | null}                      -> {"bid": id, "state": ..., "notify": ...}
        lo: offset into this peer's buffer; ro: absolute remote address
    {"cmd": "notifies", "timeout": s}                         -> {"notifies": [[sender, b64], ...]}
    {"cmd": "exit"}
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import sys

import numpy as np

from protos import registry_pb2
from transfer_svc import Op, TransferEngine

# the child runs with the repository root as cwd and first on PYTHONPATH, so it imports this tree
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fill_bytes(buf: np.ndarray, seed: int) -> None:
    """Deterministic pseudo-random bytes (numpy PCG64) into a uint8 buffer."""
    buf[:] = np.random.default_rng(seed).integers(0, 256, size=buf.size, dtype=np.uint8)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True)
    p.add_argument("--transports", default=None)
    p.add_argument("--size", type=int, required=True, help="bytes of the registered buffer")
    p.add_argument("--fill-seed", type=int, default=None)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--spin", type=float, default=0.0005)
    p.add_argument("--registry", default=None, help="publish the segment in this registry")
    p.add_argument("--role", default="decode")
    p.add_argument("--ttl", type=int, default=10)
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (the buffer lives there)")
    args = p.parse_args(argv)
    host = np.zeros(args.size, dtype=np.uint8)
    if args.fill_seed is not None:
        fill_bytes(host, args.fill_seed)
    dev = None
    if args.device != "cpu":
        import torch

        dev = torch.from_numpy(host).to(args.device)
        torch.cuda.synchronize()
    buf = host

    def snapshot() -> np.ndarray:
        """The buffer's current bytes as host memory."""
        if dev is None:
            return buf
        import torch

        torch.cuda.synchronize()
        return dev.cpu().numpy()
    eng = TransferEngine(args.name, transports=args.transports, timeout_s=args.timeout,
                         spin_s=args.spin)
    base = buf.ctypes.data if dev is None else dev.data_ptr()
    eng.register_memory(base, args.size, args.device)
    segs = {}

    def reply(obj) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reg = None
    if args.registry:
        from transfer_svc.registry_client import RegistryClient

        reg = RegistryClient(args.registry, worker_id=args.name, role=args.role, ttl_s=args.ttl)
        reg.publish(eng.publish())
        eng.resolver = reg
    reply({"descriptor": base64.b64encode(eng.publish().SerializeToString()).decode(), "base": base})
    for line in sys.stdin:
        try:
            c = json.loads(line)
            cmd = c["cmd"]
            if cmd == "exit":
                break
            if cmd == "sha256":
                o, n = c["offset"], c["length"]
                reply({"sha256": hashlib.sha256(snapshot()[o:o + n].tobytes()).hexdigest()})
            elif cmd == "fill":
                fill_bytes(buf, c["seed"])
                if dev is not None:
                    dev.copy_(torch.from_numpy(buf))
                    torch.cuda.synchronize()
                reply({"ok": True})
            elif cmd == "open":
                if "descriptor" in c:
                    target = registry_pb2.SegmentDescriptor.FromString(
                        base64.b64decode(c["descriptor"]))
                else:
                    target = c["name"]
                seg = eng.open_segment(target)
                segs[seg.name] = seg
                reply({"name": seg.name, "incarnation": seg.incarnation})
            elif cmd == "submit":
                seg = segs[c["segment"]]
                descs = [(base + lo, ro, n) for lo, ro, n in c["descs"]]
                bid = eng.submit(seg, descs, Op[c.get("op", "WRITE")])
                out = {"bid": bid}
                if c.get("notify") is not None:
                    out["notify_id"] = eng.send_notify(seg, base64.b64decode(c["notify"]))
                if c.get("wait", True):
                    st = eng.wait(bid)
                    out.update(state=st.state.value, reason=st.reason)
                    if "notify_id" in out:
                        out["notify_state"] = eng.wait(out["notify_id"]).state.value
                reply(out)
            elif cmd == "notifies":
                got = eng.wait_notify(c.get("timeout", 0.0))
                reply({"notifies": [[n.sender, base64.b64encode(n.payload).decode()] for n in got]})
            else:
                reply({"error": f"unknown cmd {cmd!r}"})
        except Exception as e:  # noqa: BLE001 - report to the driver, keep serving
            reply({"error": f"{type(e).__name__}: {e}"})
    if reg is not None:
        reg.close()
    eng.close()
    return 0


class PeerProcess:
    """Driver of a `python -m tests.integration.transfer_peer` child process.

    Starts it, reads its descriptor, and sends commands (`request(dict) -> dict`, raising
    RuntimeError on an error reply or when no reply comes within `timeout` seconds)."""

    def __init__(self, name: str, *, size: int, transports: str | None = None,
                 fill_seed: int | None = None, timeout_s: float = 10.0, registry: str | None = None,
                 role: str = "decode", ttl: int = 10, start_timeout: float = 60.0,
                 device: str = "cpu"):
        import subprocess

        cmd = [sys.executable, "-m", "tests.integration.transfer_peer", "--name", name,
               "--size", str(size), "--timeout", str(timeout_s), "--role", role, "--ttl", str(ttl),
               "--device", device]
        if transports:
            cmd += ["--transports", transports]
        if fill_seed is not None:
            cmd += ["--fill-seed", str(fill_seed)]
        if registry:
            cmd += ["--registry", registry]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = _REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self.name = name
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, cwd=_REPO_ROOT)
        first = self._readline(start_timeout)
        self.descriptor = registry_pb2.SegmentDescriptor.FromString(
            base64.b64decode(first["descriptor"]))
        self.base = first["base"]

    def _readline(self, timeout: float) -> dict:
        import select

        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not r:
            raise RuntimeError(f"peer {self.name}: no reply within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer {self.name} exited (rc={self.proc.poll()})")
        return json.loads(line)

    def request(self, obj: dict, timeout: float = 60.0) -> dict:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()
        out = self._readline(timeout)
        if "error" in out:
            raise RuntimeError(f"peer {self.name}: {out['error']}")
        return out

    def sha256(self, offset: int, length: int) -> str:
        return self.request({"cmd": "sha256", "offset": offset, "length": length})["sha256"]

    def kill(self, sig: int = 9) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - fall back to killing it
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:  # noqa: BLE001
                pass


if __name__ == "__main__":
    sys.exit(main())
