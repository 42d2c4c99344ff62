"""A standalone transfer-engine peer process, driven by JSON lines on stdin (tests and bench/transfer.py).

    python -m transfer_svc.peer --name b --transports tcp --size 134217728 [--fill-seed 3]

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
import sys

import numpy as np

from protos import registry_pb2
from transfer_svc.engine import Op, TransferEngine


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
    args = p.parse_args(argv)
    buf = np.zeros(args.size, dtype=np.uint8)
    if args.fill_seed is not None:
        fill_bytes(buf, args.fill_seed)
    eng = TransferEngine(args.name, transports=args.transports, timeout_s=args.timeout,
                         spin_s=args.spin)
    base = buf.ctypes.data
    eng.register_memory(base, buf.nbytes, "cpu")
    segs = {}

    def reply(obj) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"descriptor": base64.b64encode(eng.publish().SerializeToString()).decode(), "base": base})
    for line in sys.stdin:
        try:
            c = json.loads(line)
            cmd = c["cmd"]
            if cmd == "exit":
                break
            if cmd == "sha256":
                o, n = c["offset"], c["length"]
                reply({"sha256": hashlib.sha256(buf[o:o + n].tobytes()).hexdigest()})
            elif cmd == "fill":
                fill_bytes(buf, c["seed"])
                reply({"ok": True})
            elif cmd == "open":
                desc = registry_pb2.SegmentDescriptor.FromString(base64.b64decode(c["descriptor"]))
                segs[desc.name] = eng.open_segment(desc)
                reply({"name": desc.name})
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
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
