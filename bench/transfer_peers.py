"""The engines the transfer benchmark compares, each as a target (owns the destination buffer) and an
initiator (writes into it from its source buffer): halfmoon's TransferEngine, NIXL and Mooncake.

Engine names: halfmoon-sm / halfmoon-tcp / halfmoon-sm-peer, nixl-sm / nixl-tcp, mooncake-tcp (and
``memcpy``, which the controller runs itself: see bench/transfer_workloads.py)."""

from __future__ import annotations

import base64
import os
import subprocess
import sys

ENGINES = ["halfmoon-sm", "halfmoon-tcp", "nixl-sm", "nixl-tcp", "mooncake-tcp", "memcpy"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tls_env(engine: str) -> dict[str, str]:
    """Environment of an engine's two processes: NIXL's UCX transports and socket buffers."""
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


def _mooncake():
    from mooncake.engine import TransferEngine as MooncakeEngine

    eng = MooncakeEngine()
    if eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake initialize failed")
    return eng


def open_target(engine: str, base: int, size: int):
    """Register [base, base + size) with ``engine`` as a target: (the engine object, to keep until
    the end and then ``close``; what an initiator needs to reach it)."""
    if engine.startswith("halfmoon"):
        from transfer_svc import TransferEngine

        keep = TransferEngine(f"target-{os.getpid()}", **_halfmoon_args(engine))
        keep.register_memory(base, size)
        info = {"descriptor": base64.b64encode(keep.publish().SerializeToString()).decode()}
    elif engine.startswith("nixl"):
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        keep = nixl_agent(f"target-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        keep.register_memory([(base, size, 0, "")], "DRAM")
        info = {"metadata": base64.b64encode(keep.get_agent_metadata()).decode()}
    elif engine == "mooncake-tcp":
        keep = _mooncake()
        if keep.register_memory(base, size) != 0:
            raise RuntimeError("mooncake register_memory failed")
        info = {"session": f"127.0.0.1:{keep.get_rpc_port()}"}
    else:
        raise ValueError(engine)
    info["base"] = base
    return keep, info


def open_initiator(engine: str, target: dict, sbase: int, size: int):
    """Register the source [sbase, sbase + size) with ``engine`` and reach ``target`` (open_target's
    info): (the engine object, to ``close`` at the end; prepare(descs) -> a prepared batch;
    run(prepared), which returns at remote completion)."""
    tbase = target["base"]
    if engine.startswith("halfmoon"):
        from protos import registry_pb2
        from transfer_svc import State, TransferEngine

        eng = TransferEngine(f"init-{os.getpid()}", **_halfmoon_args(engine))
        eng.register_memory(sbase, size)
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

        eng = nixl_agent(f"init-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        eng.register_memory([(sbase, size, 0, "")], "DRAM")
        remote = eng.add_remote_agent(base64.b64decode(target["metadata"]))

        def prepare(descs):
            local = eng.get_xfer_descs([(sbase + s, n, 0) for s, d, n in descs], "DRAM")
            rem = eng.get_xfer_descs([(tbase + d, n, 0) for s, d, n in descs], "DRAM")
            return eng.initialize_xfer("WRITE", local, rem, remote)

        def run(handle):
            state = eng.transfer(handle)
            while state == "PROC":
                state = eng.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"nixl transfer {state}")
    elif engine == "mooncake-tcp":
        eng = _mooncake()
        eng.register_memory(sbase, size)

        def prepare(descs):
            return ([sbase + s for s, _, _ in descs], [tbase + d for _, d, _ in descs],
                    [n for _, _, n in descs])

        def run(p):
            if eng.batch_transfer_sync_write(target["session"], *p) != 0:
                raise RuntimeError("mooncake transfer failed")
    else:
        raise ValueError(engine)
    return eng, prepare, run


def close(engine: str, keep) -> None:
    """Close a halfmoon engine; NIXL and Mooncake objects are left to the worker's exit."""
    if engine.startswith("halfmoon"):
        keep.close()


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
