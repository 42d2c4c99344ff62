"""Command-line flags for an :class:`~engine.config.EngineConfig` (shared by `halfmoon generate
--offline`, the prefill/decode workers and the benchmarks)."""

from __future__ import annotations

import argparse

from engine.config import EngineConfig
from engine.device import check_device, device_spec
from engine.kvcache.kv_pool import KV_LAYOUTS


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=d.model, help="model name from the cache, a HF directory, or a "
                   "shape name with --load-format dummy (default %(default)s)")
    g.add_argument("--load-format", default=d.load_format, choices=["auto", "dummy"])
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default=d.device, type=device_spec, help="cpu | cuda | cuda:N")
    g.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    g.add_argument("--kv-memory", default=str(d.kv_memory),
                   help="KV pool budget: bytes ('2GiB', '536870912') or a fraction of free memory ('0.1')")
    g.add_argument("--num-pages", type=int, default=None, help="KV pages (overrides --kv-memory)")
    g.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    g.add_argument("--max-context", type=int, default=None, help="tokens per request (default: the model's)")
    g.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
    g.add_argument("--disable-radix-cache", action="store_true")
    g.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (default: 1 when --workers-on-host > 1, else torch's)")
    g.add_argument("--workers-on-host", type=int, default=1, help="engine processes sharing this machine")
    g.add_argument("--attention-backend", default=d.attention_backend)
    g.add_argument("--kv-layout", default=d.kv_layout, choices=KV_LAYOUTS,
                   help="KV pool layout: page_major (a page run is one transfer put) | layer_major")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the parsed flags. Raises SystemExit (one line) for a CUDA ``--device`` this
    process cannot use (``engine.device.check_device``)."""
    from engine.config import parse_bytes

    check_device(args.device)

    return EngineConfig(
        model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
        page_size=args.page_size, kv_memory=parse_bytes(args.kv_memory), num_pages=args.num_pages,
        max_running_requests=args.max_running_requests, max_context=args.max_context,
        chunked_prefill_size=args.chunked_prefill_size, disable_radix_cache=args.disable_radix_cache,
        torch_threads=args.torch_threads, workers_on_host=args.workers_on_host,
        attention_backend=args.attention_backend, kv_layout=args.kv_layout)
