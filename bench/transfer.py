"""Transfer benchmark: halfmoon's engine vs NIXL vs Mooncake vs a memcpy ceiling (not a test).

    .venv/bin/python -m bench.transfer [--reps 9] [--engines halfmoon-sm,halfmoon-tcp,...]
                                       [--out bench/results/transfer.json]

Every engine runs as two processes on loopback: an *initiator* that writes from its 128 MiB source
buffer and a *target* that owns a 128 MiB destination buffer (and progresses its side). The
controller (this process) sends "run workload W" to one initiator at a time, alternating engines
within each repetition, and records the seconds from the first post to remote completion. The first
repetition is a warm-up and is dropped. It also records the CPU seconds both processes used per run
(all threads, `time.process_time`), i.e. GB per CPU-second. After the warm-up the controller checks that each target's buffer
hashes to what replaying the same copies locally predicts.

Workloads (bytes moved per run in brackets):
  scattered      512 writes of 128 KiB, source and destination slots randomly permuted  [64 MiB]
  large          one 64 MiB write                                                      [64 MiB]
  kv_layer       KV-shaped, per-layer pool (layer_major; docs/architecture.md, KV memory):
                 SmolLM2-135M fp32 (30 layers, 3 KV heads, head_dim 64, page 16 tokens -> 12 KiB per
                 page per buffer), a 1024-token delta of 64 pages in 8 runs of 8 pages: one write per
                 run per layer per K/V = 480 writes
  kv_page_major  the same pages in a page-major pool (all 30 x K/V of a page contiguous, 720 KiB):
                 one write per run = 8 writes
  kv_contiguous  the same bytes as one write (a staging buffer gathered on one side)
  kv_one_page    a one-page delta in the per-layer pool: 60 writes of 12 KiB (latency: see `us`)

Engines:
  halfmoon-sm / halfmoon-tcp   transfer_svc's engine over UCX `sm` (cma zero-copy) / `tcp`
  halfmoon-sm-peer             UCX_TLS=sm,tcp with UCX error-handling mode PEER (not in the default
                               list: it shows what that mode costs on one host)
  nixl-tcp / nixl-sm           NIXL (nixl-cu12, UCX backend, progress thread on); UCX_TLS=tcp or
                               sm,tcp (NIXL does not connect with sm alone); 8 MiB socket buffers
  mooncake-tcp                 Mooncake transfer engine (P2PHANDSHAKE, tcp), batch_transfer_sync_write
  memcpy                       numpy copies of the same descriptors inside one process (ceiling)
A peer whose package is missing is reported as skipped (install them with
`pip install -e '.[transfer-peers]'`; Mooncake also needs Debian libibverbs1).

This module is the controller; the workloads are in bench/transfer_workloads.py, the engines in
bench/transfer_peers.py, the worker processes in bench/transfer_worker.py and the tables in
bench/transfer_report.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

from bench.transfer_peers import ENGINES, ROOT, available, tls_env
from bench.transfer_report import build_report, print_report
from bench.transfer_worker import Proc, private_stdout, run_initiator, run_target
from bench.transfer_workloads import REGION, WORKLOADS, fill, make_workloads, memcpy_run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9, help="repetitions (the first is a warm-up)")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "transfer.json"))
    ap.add_argument("--worker", choices=["target", "initiator"], help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--target-info", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        private_stdout()
    if args.worker == "target":
        run_target(args.engine)
        return 0
    if args.worker == "initiator":
        run_initiator(args.engine, json.loads(args.target_info))
        return 0

    engines = [e for e in args.engines.split(",") if e]
    wnames = [w for w in args.workloads.split(",") if w]
    workloads = make_workloads()
    skipped, procs, live = {}, {}, []
    for e in engines:
        if e == "memcpy":
            live.append(e)
            continue
        why = available(e)
        if why:
            skipped[e] = why
            print(f"skip {e}: {why}", flush=True)
            continue
        env = tls_env(e)
        tgt = Proc(["--worker", "target", "--engine", e], env)
        try:
            info = tgt.read()
            ini = Proc(["--worker", "initiator", "--engine", e, "--target-info", json.dumps(info)], env)
            ini.read()
            for w in wnames:
                ini.ask({"cmd": "load", "name": w, "descs": workloads[w]})
        except Exception as ex:  # noqa: BLE001 - report and go on with the others
            skipped[e] = f"failed to start: {ex}"
            print(f"skip {e}: {skipped[e]}", flush=True)
            tgt.close()
            continue
        procs[e] = (tgt, ini)
        live.append(e)
    msrc = np.zeros(REGION, dtype=np.uint8)
    fill(msrc, 1)
    mdst = np.zeros(REGION, dtype=np.uint8)

    times: dict[str, dict[str, list[float]]] = {e: {w: [] for w in wnames} for e in live}
    cpus: dict[str, dict[str, list[float]]] = {e: {w: [] for w in wnames} for e in live}
    verified = {}
    for rep in range(args.reps):
        for w in wnames:
            order = live[rep % len(live):] + live[:rep % len(live)]  # rotate who goes first
            for e in order:
                if e == "memcpy":
                    c0 = time.process_time()
                    t = memcpy_run(msrc, mdst, workloads[w])
                    cpu = time.process_time() - c0
                else:
                    tgt, ini = procs[e]
                    before = tgt.ask({"cmd": "cpu"})["cpu"]
                    r = ini.ask({"cmd": "run", "name": w})
                    t, cpu = r["seconds"], r["cpu"] + tgt.ask({"cmd": "cpu"})["cpu"] - before
                if rep > 0:
                    times[e][w].append(t)
                    cpus[e][w].append(cpu)
        if rep == 0:
            expected = np.zeros(REGION, dtype=np.uint8)
            for w in wnames:  # the target saw every workload once, in this order: replay them
                memcpy_run(msrc, expected, workloads[w])
            want = hashlib.sha256(expected).hexdigest()
            for e in live:
                if e != "memcpy":
                    got = procs[e][0].ask({"cmd": "sha256", "offset": 0, "length": REGION})["sha256"]
                    verified[e] = got == want
                    if not verified[e]:
                        print(f"WARNING: {e}: target bytes differ from the expected copy", flush=True)
    for tgt, ini in procs.values():
        ini.close()
        tgt.close()

    report = build_report(times, cpus, workloads, wnames, live, args.reps - 1, skipped, verified)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print_report(report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
