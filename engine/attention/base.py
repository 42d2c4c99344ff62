"""Attention-backend interface.

A backend owns nothing but per-forward metadata: :meth:`init_forward` runs once per
:class:`~engine.forward_batch.ForwardBatch` (before layer 0), then every layer calls :meth:`forward`,
which stores the new tokens' K/V at ``batch.out_cache_loc`` and attends over each request's row
``req_to_token[row, 0:seq_len]`` (causal within the extend part).
"""

from __future__ import annotations

import abc

import torch

from engine.forward_batch import ForwardBatch
from engine.kvcache.kv_pool import KVPool
from engine.kvcache.req_to_token_pool import ReqToTokenPool


class AttentionBackend(abc.ABC):
    def __init__(self, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool, num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float | None = None):
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self._loc_batch: ForwardBatch | None = None
        self._loc: tuple[torch.Tensor, torch.Tensor] | None = None

    def store_kv(self, layer: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """``KVPool.write`` of this layer's new K/V at ``batch.out_cache_loc``, the slots' (page,
        offset) computed once per forward instead of once per layer (on a GPU: two kernels fewer per
        layer). Recomputed at layer 0 even for the same batch object: the CUDA-graph runner runs one
        static batch through warm-ups and then the capture, and the capture must record the
        computation, not reuse tensors computed before it."""
        if layer == 0 or self._loc_batch is not batch:
            self._loc = self.kv_pool.locate(batch.out_cache_loc)
            self._loc_batch = batch
        self.kv_pool.write(layer, batch.out_cache_loc, k, v, self._loc)

    #: True when the backend has :meth:`attend` (attention over K/V the caller stored itself).
    has_attend = False
    #: True when the caller's fused K/V store before :meth:`attend` is to be launched with
    #: programmatic dependent launch, because ``attend`` waits for it (engine.cuda_graph_runner).
    pdl = False

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
               batch: ForwardBatch) -> torch.Tensor:
        """:meth:`forward` without the K/V store, for a caller that has already written this layer's
        new K/V at ``batch.out_cache_loc`` (engine.fused_ops stores them with RoPE in one kernel).
        Shapes as :meth:`forward`. Raises NotImplementedError where ``has_attend`` is False: those
        backends store inside their attention call."""
        raise NotImplementedError(f"{type(self).__name__} stores K/V inside forward; it has no attend")

    @abc.abstractmethod
    def init_forward(self, batch: ForwardBatch) -> None:
        """Precompute what all layers share for this batch (gather indices, masks, ...)."""

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                batch: ForwardBatch) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (new tokens only).

        Writes k, v at ``batch.out_cache_loc`` of ``layer``; returns [T, num_heads * head_dim].
        """
