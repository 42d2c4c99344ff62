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
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import select
import statistics
import subprocess
import sys
import time

import numpy as np

MiB = 1 << 20
REGION = 128 * MiB
CHUNK = 128 * 1024
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# SmolLM2-135M KV shape (its config.json): fp32, page 16 tokens
KV_LAYERS, KV_HEADS, HEAD_DIM, PAGE_TOKENS, DTYPE_BYTES = 30, 3, 64, 16, 4
PAGE_BYTES = PAGE_TOKENS * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # 12 KiB per page per buffer
N_BUFFERS = 2 * KV_LAYERS
POOL_PAGES = REGION // (N_BUFFERS * PAGE_BYTES)  # pages per buffer that fit in the region
DELTA_RUNS, RUN_PAGES = 8, 8

ENGINES = ["halfmoon-sm", "halfmoon-tcp", "nixl-sm", "nixl-tcp", "mooncake-tcp", "memcpy"]
WORKLOADS = ["scattered", "large", "kv_layer", "kv_page_major", "kv_contiguous", "kv_one_page"]


# ----------------------------------------------------------------------------- workloads
def _runs(rng: np.random.Generator) -> list[int]:
    """Start pages of DELTA_RUNS non-overlapping runs of RUN_PAGES pages in the pool."""
    slots = rng.permutation(POOL_PAGES // RUN_PAGES)[:DELTA_RUNS]
    return [int(s) * RUN_PAGES for s in slots]


def make_workloads(seed: int = 0) -> dict[str, list[tuple[int, int, int]]]:
    """name -> [(src offset, dst offset, bytes)] within the 128 MiB source / destination buffers."""
    rng = np.random.default_rng(seed)
    src_slots = rng.permutation(REGION // CHUNK)[:512]
    dst_slots = rng.permutation(REGION // CHUNK)[:512]
    w = {"scattered": [(int(s) * CHUNK, int(d) * CHUNK, CHUNK) for s, d in zip(src_slots, dst_slots)],
         "large": [(0, 32 * MiB, 64 * MiB)]}
    src_runs, dst_runs = _runs(rng), _runs(rng)
    buf_bytes = POOL_PAGES * PAGE_BYTES
    # per-layer pool: buffer b (= 2*layer + k/v) is [POOL_PAGES pages] at b * buf_bytes
    w["kv_layer"] = [(b * buf_bytes + sp * PAGE_BYTES, b * buf_bytes + dp * PAGE_BYTES,
                      RUN_PAGES * PAGE_BYTES)
                     for b in range(N_BUFFERS) for sp, dp in zip(src_runs, dst_runs)]
    stride = N_BUFFERS * PAGE_BYTES  # page-major: page p holds every buffer's page p
    w["kv_page_major"] = [(sp * stride, dp * stride, RUN_PAGES * stride)
                          for sp, dp in zip(src_runs, dst_runs)]
    total = sum(n for _, _, n in w["kv_layer"])
    w["kv_contiguous"] = [(0, 0, total)]
    # a short request's delta: one page, per-layer pool -> 60 writes of 12 KiB (latency-bound)
    w["kv_one_page"] = [(b * buf_bytes + src_runs[0] * PAGE_BYTES, b * buf_bytes + dst_runs[0] * PAGE_BYTES,
                         PAGE_BYTES) for b in range(N_BUFFERS)]
    return w


def fill(buf: np.ndarray, seed: int) -> None:
    buf[:] = np.random.default_rng(seed).integers(0, 256, size=buf.size, dtype=np.uint8)


# ----------------------------------------------------------------------------- worker processes
_OUT = sys.stdout  # replaced in worker processes by a private copy of fd 1


def _private_stdout() -> None:
    """Workers answer on a dup of fd 1 and point fd 1 at stderr: libraries (NIXL, Mooncake) print."""
    global _OUT
    _OUT = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)


def _reply(obj) -> None:
    _OUT.write(json.dumps(obj) + "\n")
    _OUT.flush()


def _tls_env(engine: str) -> dict[str, str]:
    env = {}
    if engine.startswith("nixl"):
        env["UCX_TLS"] = "tcp" if engine == "nixl-tcp" else "sm,tcp"
        env.setdefault("UCX_TCP_SNDBUF", "8m")
        env.setdefault("UCX_TCP_RCVBUF", "8m")
    return env


def _halfmoon_args(engine: str) -> dict:
    """TransferEngine arguments of a halfmoon-* engine name. Knobs (env): HALFMOON_BENCH_SPIN_S,
    HALFMOON_BENCH_BUSY_POLL=1."""
    kw: dict = {"transports": engine.split("-")[1]}
    if engine.endswith("-peer"):  # UCX error-handling mode PEER: sm alone cannot connect in it
        kw = {"transports": "sm,tcp", "error_mode": "peer"}
    if os.environ.get("HALFMOON_BENCH_SPIN_S"):
        kw["spin_s"] = float(os.environ["HALFMOON_BENCH_SPIN_S"])
    if os.environ.get("HALFMOON_BENCH_BUSY_POLL") == "1":
        kw["busy_poll"] = True
    return kw


def run_target(engine: str) -> None:
    buf = np.zeros(REGION, dtype=np.uint8)
    base = buf.ctypes.data
    keep = None
    if engine.startswith("halfmoon"):
        from transfer_svc import TransferEngine

        keep = TransferEngine(f"target-{os.getpid()}", **_halfmoon_args(engine))
        keep.register_memory(base, REGION)
        info = {"descriptor": base64.b64encode(keep.publish().SerializeToString()).decode()}
    elif engine.startswith("nixl"):
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        keep = nixl_agent(f"target-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        keep.register_memory([(base, REGION, 0, "")], "DRAM")
        info = {"metadata": base64.b64encode(keep.get_agent_metadata()).decode()}
    elif engine == "mooncake-tcp":
        from mooncake.engine import TransferEngine as MooncakeEngine

        keep = MooncakeEngine()
        if keep.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("mooncake initialize failed")
        if keep.register_memory(base, REGION) != 0:
            raise RuntimeError("mooncake register_memory failed")
        info = {"session": f"127.0.0.1:{keep.get_rpc_port()}"}
    else:
        raise ValueError(engine)
    info["base"] = base
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
    if engine.startswith("halfmoon"):
        keep.close()


def run_initiator(engine: str, target: dict) -> None:
    src = np.zeros(REGION, dtype=np.uint8)
    fill(src, 1)
    sbase, tbase = src.ctypes.data, target["base"]
    prepared = {}
    if engine.startswith("halfmoon"):
        from protos import registry_pb2
        from transfer_svc import State, TransferEngine

        eng = TransferEngine(f"init-{os.getpid()}", **_halfmoon_args(engine))
        eng.register_memory(sbase, REGION)
        seg = eng.open_segment(registry_pb2.SegmentDescriptor.FromString(
            base64.b64decode(target["descriptor"])))

        def prepare(descs):
            return [(sbase + s, tbase + d, n) for s, d, n in descs]

        def run(p):
            st = eng.wait(eng.submit(seg, p))
            if st.state is not State.COMPLETED:
                raise RuntimeError(st)
    elif engine.startswith("nixl"):
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        agent = nixl_agent(f"init-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        agent.register_memory([(sbase, REGION, 0, "")], "DRAM")
        remote = agent.add_remote_agent(base64.b64decode(target["metadata"]))

        def prepare(descs):
            local = agent.get_xfer_descs([(sbase + s, n, 0) for s, d, n in descs], "DRAM")
            rem = agent.get_xfer_descs([(tbase + d, n, 0) for s, d, n in descs], "DRAM")
            return agent.initialize_xfer("WRITE", local, rem, remote)

        def run(handle):
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"nixl transfer {state}")
    elif engine == "mooncake-tcp":
        from mooncake.engine import TransferEngine as MooncakeEngine

        eng = MooncakeEngine()
        if eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("mooncake initialize failed")
        eng.register_memory(sbase, REGION)

        def prepare(descs):
            return ([sbase + s for s, _, _ in descs], [tbase + d for _, d, _ in descs],
                    [n for _, _, n in descs])

        def run(p):
            if eng.batch_transfer_sync_write(target["session"], *p) != 0:
                raise RuntimeError("mooncake transfer failed")
    else:
        raise ValueError(engine)
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
    if engine.startswith("halfmoon"):
        eng.close()


class Proc:
    def __init__(self, args: list[str], env: dict[str, str]):
        full_env = dict(os.environ, OMP_NUM_THREADS="1", **env)
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        self.p = subprocess.Popen([sys.executable, "-m", "bench.transfer", *args], cwd=ROOT,
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


def available(engine: str) -> str | None:
    """None if the engine can run here, else why not."""
    mod = {"nixl": "nixl_cu12", "mooncake": "mooncake.engine"}.get(engine.split("-")[0])
    if mod is None:
        return None
    try:
        r = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return f"import {mod} timed out"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        pkg = {"nixl_cu12": "nixl-cu12", "mooncake.engine":
               "mooncake-transfer-engine-non-cuda (+ Debian libibverbs1)"}[mod]
        return f"not installed or not loadable ({last}); pip install {pkg}"
    return None


def memcpy_run(src: np.ndarray, dst: np.ndarray, descs) -> float:
    t0 = time.perf_counter()
    for s, d, n in descs:
        dst[d:d + n] = src[s:s + n]
    return time.perf_counter() - t0


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
        _private_stdout()
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
        env = _tls_env(e)
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

    results = {}
    for e in live:
        results[e] = {}
        for w in wnames:
            nbytes = sum(n for _, _, n in workloads[w])
            ts = times[e][w]
            gbs = sorted(nbytes / t / 1e9 for t in ts)
            results[e][w] = {"bytes": nbytes, "ops": len(workloads[w]), "seconds": ts,
                             "gbps_median": statistics.median(gbs), "gbps_min": gbs[0],
                             "gbps_max": gbs[-1], "us_median": statistics.median(ts) * 1e6,
                             "cpu_seconds": cpus[e][w],
                             "gb_per_cpu_s_median": statistics.median(
                                 nbytes / max(c, 1e-6) / 1e9 for c in cpus[e][w])}

    def med(e, w):
        return results.get(e, {}).get(w, {}).get("gbps_median")

    ratios = {}
    for w in wnames:
        r = {}
        for num, den in [("halfmoon-tcp", "mooncake-tcp"), ("halfmoon-tcp", "nixl-tcp"),
                         ("halfmoon-sm", "nixl-sm"), ("halfmoon-sm", "memcpy")]:
            if med(num, w) and med(den, w):
                r[f"{num}/{den}"] = med(num, w) / med(den, w)
        ratios[w] = r
    kv = {}
    for e in live:
        if all(med(e, w) for w in ("kv_layer", "kv_contiguous")):
            kv[e] = {"per_layer_over_contiguous": med(e, "kv_layer") / med(e, "kv_contiguous")}
            if med(e, "kv_page_major"):
                kv[e]["page_major_over_contiguous"] = med(e, "kv_page_major") / med(e, "kv_contiguous")
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "reps": args.reps - 1,
              "cpus": os.cpu_count(), "results": results, "ratios": ratios, "kv_layout": kv,
              "skipped": skipped, "verified": verified,
              "workload_bytes": {w: sum(n for _, _, n in workloads[w]) for w in wnames},
              "workload_ops": {w: len(workloads[w]) for w in wnames}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)

    print(f"\nGB/s, median [min-max] of {args.reps - 1} runs (after 1 warm-up), alternating engines")
    head = f"{'engine':<14}" + "".join(f"{w + ' (' + str(len(workloads[w])) + ')':>26}" for w in wnames)
    print(head)
    for e in live:
        cells = []
        for w in wnames:
            r = results[e][w]
            cells.append(f"{r['gbps_median']:6.2f} [{r['gbps_min']:5.2f}-{r['gbps_max']:5.2f}]")
        print(f"{e:<14}" + "".join(f"{c:>26}" for c in cells))
    print("\nCPU efficiency: GB moved per CPU-second of initiator + target processes (all threads),"
          " median; less sensitive to a loaded machine than wall-clock GB/s")
    print(f"{'engine':<14}" + "".join(f"{w:>16}" for w in wnames))
    for e in live:
        print(f"{e:<14}" + "".join(f"{results[e][w]['gb_per_cpu_s_median']:16.2f}" for w in wnames))
    if "kv_one_page" in wnames:
        print("\nkv_one_page batch latency, median µs: " + ", ".join(
            f"{e} {results[e]['kv_one_page']['us_median']:.0f}" for e in live))
    print("\nratios of medians:")
    for w, r in ratios.items():
        print(f"  {w:<14} " + "  ".join(f"{k} {v:.2f}" for k, v in r.items()))
    print("\nKV layout: per-layer puts / one contiguous put, page-major / contiguous:")
    for e, r in kv.items():
        print(f"  {e:<14} " + "  ".join(f"{k} {v:.2f}" for k, v in r.items()))
    for e, why in skipped.items():
        print(f"skipped {e}: {why}")
    print(f"verified (target bytes after the warm-up round): {verified}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
