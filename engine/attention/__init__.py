"""Attention backends: ``torch`` (any device, the reference). A ``flashinfer`` backend plugs in here."""

from __future__ import annotations

from engine.attention.base import AttentionBackend


def create_backend(name: str, **kw) -> AttentionBackend:
    """Build a backend by name. Raises ValueError(\"attention_backend: ...\") for unknown names."""
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(**kw)
    raise ValueError(f"attention_backend: unknown backend {name!r}; available: ['torch']")
