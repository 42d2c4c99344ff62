"""Command-line flags for an :class:`~engine.config.EngineConfig` (`halfmoon generate --offline`: the
co-located engine). Names and meanings match the flags of the prefill/decode workers
(``pd_common.worker_runtime``)."""

from __future__ import annotations

import argparse
import math

from engine.attention import BACKENDS
from engine.config import EngineConfig
from engine.device import check_device, device_spec
from engine.kvcache.kv_pool import KV_LAYOUTS
from engine.models.cpu_linear import CpuLinear


class _Replaced(argparse.Action):
    """A flag that no longer exists: using it is an argparse error naming its replacement."""

    def __init__(self, option_strings, dest, replacement: str, **kw):
        self.replacement = replacement
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {self.replacement} (the KV pool budget in MiB, as on "
                     f"halfmoon up / serve-prefill / serve-decode), e.g. {self.replacement} 512")


def non_negative_int(value: str) -> int:
    """argparse type: an int >= 0 (argparse names the flag in the error)."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is negative")
    return n


def int_at_least(minimum: int):
    """argparse type factory: an int >= ``minimum`` (argparse names the flag in the error)."""
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"expected >= {minimum}, got {n}")
        return n
    return parse


def non_negative_float(value: str) -> float:
    """argparse type: a finite float >= 0 (argparse names the flag in the error)."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not math.isfinite(x) or x < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a finite number >= 0")
    return x


def positive_float(value: str) -> float:
    """argparse type: a finite float > 0 (argparse names the flag in the error)."""
    x = non_negative_float(value)
    if x == 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not > 0")
    return x


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=d.model, help="model name from the cache, a HF directory, or a "
                   "shape name with --load-format dummy (default %(default)s)")
    g.add_argument("--load-format", default=d.load_format, choices=["auto", "dummy"])
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default=d.device, type=device_spec, help="cpu | cuda | cuda:N")
    g.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    g.add_argument("--kv-memory-mb", type=float, default=None,
                   help="KV pool budget in MiB, the flag of every halfmoon command; unset: "
                        f"{d.kv_memory * 100:g}%% of the device's free memory")
    g.add_argument("--kv-memory", action=_Replaced, replacement="--kv-memory-mb", help=argparse.SUPPRESS)
    g.add_argument("--num-pages", type=int, default=None, help="KV pages (overrides --kv-memory-mb)")
    g.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    g.add_argument("--max-context", type=int, default=None, help="tokens per request (default: the model's)")
    g.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
    g.add_argument("--max-retractions", type=non_negative_int, default=d.max_retractions,
                   help="a request preempted this often is pinned: not chosen again while any other "
                        "running request can be")
    g.add_argument("--disable-radix-cache", action="store_true")
    g.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (default: 1 when --workers-on-host > 1, else torch's)")
    g.add_argument("--workers-on-host", type=int, default=1, help="engine processes sharing this machine")
    g.add_argument("--attention-backend", default=d.attention_backend, choices=BACKENDS,
                   help="auto: flashinfer on CUDA bf16/fp16, cpu_paged on CPU once `make kernels` built it "
                        "(else torch_paged, logged) | torch | torch_paged | cpu_paged | flashinfer")
    g.add_argument("--cpu-linear", default=d.cpu_linear, choices=[m.value for m in CpuLinear],
                   help="CPU GEMMs (float32; bfloat16 where oneDNN has native bf16 GEMMs): packed (weights packed once: the small-M kernel for decode when `make kernels` built it, oneDNN above 64 rows, 8 with bf16) | onednn (oneDNN packed only) | torch (F.linear)")
    g.add_argument("--kv-layout", default=d.kv_layout, choices=KV_LAYOUTS,
                   help="KV pool layout: page_major (a page run is one transfer put) | layer_major")
    g.add_argument("--tp", type=int_at_least(1), default=d.tp_size,
                   help="tensor-parallel ranks: this process is rank 0 and starts the others (gloo on "
                        "CPU, NCCL on CUDA: rank r on the device's index + r); the KV budget is per rank")
    g.add_argument("--tp-timeout", type=positive_float, default=d.tp_timeout_s,
                   help="seconds any tensor-parallel collective (and forming the group) may take")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the parsed flags. Raises SystemExit (one line) for a CUDA ``--device`` this
    process cannot use (``engine.device.check_device``)."""
    check_device(args.device)
    kv_memory = EngineConfig.kv_memory if args.kv_memory_mb is None else int(args.kv_memory_mb * (1 << 20))
    return EngineConfig(
        model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
        page_size=args.page_size, kv_memory=kv_memory, num_pages=args.num_pages,
        max_running_requests=args.max_running_requests, max_context=args.max_context,
        chunked_prefill_size=args.chunked_prefill_size, max_retractions=args.max_retractions,
        disable_radix_cache=args.disable_radix_cache,
        torch_threads=args.torch_threads, workers_on_host=args.workers_on_host,
        attention_backend=args.attention_backend, kv_layout=args.kv_layout, tp_size=args.tp,
        tp_timeout_s=args.tp_timeout, cpu_linear=args.cpu_linear)
