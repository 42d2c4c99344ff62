"""Which workers ``halfmoon up`` starts and with what: one :class:`WorkerPlan` per worker (its id,
role, index, tensor-parallel ranks and torch threads) and the ``serve-prefill|serve-decode`` argv.

Threads: every rank of a ``--tp N`` worker is its own process with the worker's ``--torch-threads``
(``engine/distributed/follower.py`` applies the same EngineConfig), so the cores are split over all
ranks of all workers, not over the workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from halfmoon.stack_config import StackConfig, threads_per_worker


@dataclass(frozen=True)
class WorkerPlan:
    """One worker of the stack. ``k``: its slot in the port plan (prefill first, then decode);
    ``tp``: its rank processes; ``threads``: torch threads of each rank."""
    worker_id: str
    role: str   # "prefill" | "decode"
    idx: int
    k: int
    tp: int
    threads: int


def plan_workers(cfg: StackConfig, cores: int | None = None) -> list[WorkerPlan]:
    """The stack's workers in start order. ``cores``: None = this process's CPU affinity."""
    roles = [("prefill", i, cfg.prefill_tp) for i in range(cfg.prefill)] + \
        [("decode", i, cfg.decode_tp) for i in range(cfg.decode)]
    threads = cfg.torch_threads or threads_per_worker(sum(tp for _, _, tp in roles), cores)
    return [WorkerPlan(f"{role}-{idx}", role, idx, k, tp, threads) for k, (role, idx, tp) in enumerate(roles)]


def worker_argv(cfg: StackConfig, w: WorkerPlan, ports: tuple[int, int], registry: str,
                cred_args: list[str]) -> list[str]:
    """``halfmoon`` argv of worker ``w``: ``ports`` = (gRPC, metrics), ``registry`` = host:port,
    ``cred_args`` = its credential flags. ``--tp`` comes before the role's extra args, which
    ``halfmoon.launcher`` checks carry no ``--tp`` of their own."""
    return [f"serve-{w.role}", "--model", cfg.model, "--host", cfg.host, "--port", str(ports[0]),
            "--metrics-port", str(ports[1]), "--registry", registry,
            "--advertise-host", cfg.host, "--worker-id", w.worker_id, "--page-size", str(cfg.page_size),
            "--torch-threads", str(w.threads),
            "--kv-memory-mb", str(cfg.decode_kv_memory_mb if w.role == "decode" else cfg.kv_memory_mb),
            "--device", cfg.device_of(w.role, w.idx), "--dtype", cfg.dtype, "--load-format", cfg.load_format,
            "--tp", str(w.tp), *cred_args, *context_args(cfg), *cfg.worker_args, *cfg.role_args.get(w.role, [])]


def context_args(cfg: StackConfig) -> list[str]:
    """``--max-context N`` for the router and every worker when the stack caps the context."""
    return [] if cfg.max_context is None else ["--max-context", str(cfg.max_context)]
