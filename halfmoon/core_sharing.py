"""How ``halfmoon up`` lets its CPU workers share the machine's cores (``up --cpu-share on``; off by
default, docs/architecture.md, CPU core sharing, says why).

* The share file (engine/cpu_share.py): made in the log dir and passed to every worker as
  ``--cpu-share PATH`` when there are two or more workers, all on the CPU with one rank each, and
  a worker's share of the cores is less than all of them. A busy worker then computes on the cores
  the idle ones leave.
* The OpenMP wait policy of CPU workers: ``GOMP_SPINCOUNT`` (torch's CPU wheels use GNU OpenMP,
  ``torch.__config__.parallel_info()``): a thread that finished its part of a parallel region spins
  that many rounds, then sleeps. libgomp's default spins ~300k rounds, so a worker's pool thread
  keeps burning a core the co-located worker needs, and a 2-thread forward whose other thread lost
  its core stalls: a B=8 decode step next to a busy 1-thread worker took 0.6-1.2 s instead of
  ~0.2 s. ``OMP_WAIT_POLICY=PASSIVE`` (no spin) avoids that but makes every parallel region wake
  its threads through the kernel: a 2-thread step on an idle box went from ~60 to 74-94 ms, no
  better than one thread. 10000 rounds keep the spin short (sub-millisecond) and the 2-thread
  step at ~60 ms. An ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` in ``up``'s environment is left as
  it is.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.cpu_share import CpuShare
from halfmoon.stack_config import StackConfig, cpu_count
from halfmoon.worker_plan import WorkerPlan

SPIN_COUNT = "10000"
SHARE_FILE = "cpu-share"


def share_file(cfg: StackConfig, plan: list[WorkerPlan], log_dir: Path, cores: int | None = None) -> Path | None:
    """Create the stack's share file and return its path, or None when the workers do not share
    (``cfg.cpu_share`` off, a GPU worker, a worker of several ranks, one worker, or a share that
    is already every core)."""
    cores = cores or cpu_count()
    if not cfg.cpu_share or len(plan) < 2:
        return None
    if any(w.tp != 1 or cfg.device_of(w.role, w.idx) != "cpu" for w in plan):
        return None
    if all(w.threads >= cores for w in plan):
        return None
    return CpuShare.create(log_dir / SHARE_FILE, cores, len(plan))


def worker_env(cfg: StackConfig, w: WorkerPlan) -> dict[str, str]:
    """Environment of worker ``w`` beyond ``up``'s own: its thread count, and on the CPU with
    ``cpu_share`` the short OpenMP spin (module docstring)."""
    env = {"OMP_NUM_THREADS": str(w.threads), "MKL_NUM_THREADS": str(w.threads)}
    if (cfg.cpu_share and cfg.device_of(w.role, w.idx) == "cpu"
            and "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ):
        env["GOMP_SPINCOUNT"] = SPIN_COUNT
    return env
