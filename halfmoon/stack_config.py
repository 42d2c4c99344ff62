"""What ``halfmoon up`` starts: :class:`StackConfig` (counts, ports, devices, memory, flags per role)
and the torch threads each worker gets. The port plan is in :mod:`halfmoon.launcher`'s docstring.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.model_store import DEFAULT_MODEL
from halfmoon.stack_credentials import AuthMode


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def threads_per_worker(n_workers: int, cores: int | None = None) -> int:
    """Torch intra-op threads per worker: the cores split evenly, at least 1 (1 when workers > cores)."""
    return max(1, (cores or cpu_count()) // max(1, n_workers))


@dataclass
class StackConfig:
    """What ``halfmoon up`` starts. Ports: see :mod:`halfmoon.launcher`."""
    model: str = DEFAULT_MODEL
    prefill: int = 1
    decode: int = 1
    base_port: int = 50050
    host: str = "127.0.0.1"
    policy: str = "per_role"        # the router's --policy; kv_events picks the pair (no per-role policies)
    prefill_policy: str = "cache_aware"
    decode_policy: str = "cache_aware"
    page_size: int = 16
    kv_memory_mb: float = 384.0  # one 8192-token request of the default model (46 KB/token fp32)
    # decode holds every running request's prompt and output: room for ~30 concurrent chats without
    # max_tokens at the decode projection (prompt + reserve + ratio x clip tokens each)
    decode_kv_memory_mb: float = 1024.0
    torch_threads: int = 0          # 0 = threads_per_worker(every rank of every worker)
    prefill_tp: int = 1             # tensor-parallel ranks of each prefill worker (its --tp)
    decode_tp: int = 1
    log_dir: str = ""
    ready_timeout: float = 300.0
    stop_timeout: float = 10.0
    prefill_device: str = "cpu"     # one device, or a comma list the prefill workers take in turn
    decode_device: str = "cpu"
    dtype: str = "float32"          # weights and KV of every worker (bfloat16 on GPUs)
    load_format: str = "auto"       # "dummy": random weights (--model: a shape name or a dir with config.json)
    worker_args: list[str] = field(default_factory=list)
    role_args: dict = field(default_factory=dict)  # "prefill" | "decode" -> extra argv of that role's workers
    router_args: list[str] = field(default_factory=list)
    auth: AuthMode = AuthMode.TOKEN  # token | tls | open (halfmoon.stack_credentials)
    tls_dir: str = ""               # tls: certificates from `halfmoon certs` (default: made in log_dir)
    registry: str = "memory"        # "etcd": the registry keeps records in a local etcd started here
    max_context: int | None = None  # tokens per request every worker and the router serve (None: the model's)
    cpu_share: bool = False         # CPU workers share the cores (halfmoon.core_sharing; measured slower on 2 cores)

    def device_of(self, role: str, idx: int) -> str:
        """Device of worker ``idx`` of ``role`` ("prefill" | "decode")."""
        devs = [d.strip() for d in (self.prefill_device if role == "prefill" else self.decode_device).split(",")]
        return devs[idx % len(devs)]

