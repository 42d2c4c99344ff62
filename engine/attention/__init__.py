"""Attention backends: ``torch`` (any device, the reference), ``torch_paged`` (the reference with a
page-level decode gather, bit-identical), ``cpu_paged`` (CPU, float32/bfloat16: a C++ decode kernel
reading the pool in place) and ``flashinfer`` (CUDA, bf16/fp16).

``auto`` picks flashinfer for a CUDA pool of a half type when the package imports; on CPU,
cpu_paged when its kernel is built for this machine (else torch_paged, with one log line saying
why); otherwise torch_paged.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from engine.attention.base import AttentionBackend

BACKENDS = ("auto", "torch", "torch_paged", "cpu_paged", "flashinfer")

log = logging.getLogger("halfmoon.engine.attention")
_said_why: set[str] = set()


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> ``flashinfer`` on CUDA with bf16/fp16 K/V and flashinfer installed; ``cpu_paged``
    on CPU with float32/bf16 K/V when its kernel is built (else one INFO log line per reason, per
    process); else ``torch_paged``. Other names are returned as given."""
    if name != "auto":
        return name
    dev = torch.device(device).type
    if (dev == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and importlib.util.find_spec("flashinfer") is not None):
        return "flashinfer"
    if dev == "cpu":
        from engine.attention.cpu_paged_backend import kernel_unavailable

        why = kernel_unavailable(device, dtype)
        if not why:
            return "cpu_paged"
        if why not in _said_why:
            _said_why.add(why)
            log.info("attention_backend auto: torch_paged, not cpu_paged: %s", why)
    return "torch_paged"


def create_backend(name: str, **kw) -> AttentionBackend:
    """Build a backend by name (``auto`` resolves from ``kw['kv_pool']``).

    Raises ValueError("attention_backend: ...") for unknown names or a backend that cannot serve the
    pool (flashinfer on CPU or float32; cpu_paged off CPU, on another dtype, or without its built
    kernel: the message says which and how to build it).
    """
    if name == "auto":
        pool = kw["kv_pool"]
        name = resolve_backend_name(name, pool.device, pool.dtype)
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(**kw)
    if name == "torch_paged":
        from engine.attention.torch_paged_backend import TorchPagedAttentionBackend

        return TorchPagedAttentionBackend(**kw)
    if name == "cpu_paged":
        from engine.attention.cpu_paged_backend import CpuPagedAttentionBackend

        return CpuPagedAttentionBackend(**kw)
    if name == "flashinfer":
        from engine.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(**kw)
    raise ValueError(f"attention_backend: unknown backend {name!r}; available: {list(BACKENDS)}")
