"""Attention backends: ``torch`` (any device, the reference), ``torch_paged`` (the reference with a
page-level decode gather, bit-identical) and ``flashinfer`` (CUDA, bf16/fp16).

``auto`` picks flashinfer for a CUDA pool of a half type when the package imports, else torch_paged.
"""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.base import AttentionBackend

BACKENDS = ("auto", "torch", "torch_paged", "flashinfer")


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> ``flashinfer`` on CUDA with bf16/fp16 K/V and flashinfer installed, else
    ``torch_paged``."""
    if name != "auto":
        return name
    if (torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and importlib.util.find_spec("flashinfer") is not None):
        return "flashinfer"
    return "torch_paged"


def create_backend(name: str, **kw) -> AttentionBackend:
    """Build a backend by name (``auto`` resolves from ``kw['kv_pool']``).

    Raises ValueError("attention_backend: ...") for unknown names or a backend that cannot serve the
    pool (flashinfer on CPU or float32).
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
    if name == "flashinfer":
        from engine.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(**kw)
    raise ValueError(f"attention_backend: unknown backend {name!r}; available: {list(BACKENDS)}")
