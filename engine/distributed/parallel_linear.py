"""Megatron-style tensor-parallel layers (one rank's modules; every rank of the group runs them).

* :class:`ColumnParallelLinear` holds a slice of the output features (q/k/v: its heads; gate/up:
  its intermediate columns); no communication, its output stays sharded.
* :class:`RowParallelLinear` holds the matching slice of the input features (o: its heads; down:
  its intermediate columns) and all-reduces the partial sums: one all-reduce per use.
  :class:`PackedRowParallelLinear` is the same with its local GEMM on oneDNN-packed weights (the
  CPU fused-ops path, ``engine.torch_fused_ops``); the all-reduce stays.
* :class:`VocabParallelEmbedding` holds ``vocab_per_rank`` rows; ids outside them give zeros and
  the all-reduce fills every row.
* :class:`ParallelLMHead` computes its rows' logits and gathers them to rank 0 only (sampling
  happens once, there); the other ranks return an empty ``[T, 0]`` tensor.

Weights keep the Hugging Face names (``weight`` / ``bias``), so ``engine.distributed.tp_model``
loads each as the slice of the checkpoint tensor that :attr:`shard_dim` names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.models.cpu_linear import PackedLinear


class ColumnParallelLinear(nn.Linear):
    """``y_local = x @ W[rows].T (+ b[rows])``: x [T, in] full, y [T, out_local] sharded."""

    shard_dim = 0  # the checkpoint tensor's dimension this module holds a slice of


class RowParallelLinear(nn.Linear):
    """``y = all_reduce(x_local @ W[:, cols].T)``: x [T, in_local] sharded, y [T, out] full.

    No bias (Llama's o_proj / down_proj have none); a bias would be added once, after the sum.
    """

    shard_dim = 1

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup):
        super().__init__(in_features, out_features, bias=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y


class PackedRowParallelLinear(PackedLinear):
    """A :class:`RowParallelLinear` whose local ``x_local @ W[:, cols].T`` runs on packed weights
    (float32 or natively bf16 CPU, :class:`~engine.models.cpu_linear.PackedLinear`), then the same all-reduce.
    ``weight`` is the row-parallel module's own parameter (names unchanged)."""

    def __init__(self, row: RowParallelLinear, small_rows: int = 0):
        super().__init__(row.weight, None, small_rows=small_rows)
        self.group = row.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        dist.all_reduce(y, group=self.group)
        return y


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + weight.shape[0])`` of the embedding; ``forward(ids int64 [T]) ->
    [T, hidden]`` on every rank (masked lookup, then an all-reduce)."""

    shard_dim = 0

    def __init__(self, rows: int, hidden: int, start: int, group: dist.ProcessGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.start = start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside[:, None], 0)
        dist.all_reduce(x, group=self.group)
        return x


class ParallelLMHead(nn.Module):
    """Logits of ``vocab_per_rank`` rows per rank, gathered to rank 0: ``forward(x [T, hidden])`` is
    ``[T, vocab_size]`` on rank 0 (padding rows dropped) and ``[T, 0]`` elsewhere."""

    shard_dim = 0

    def __init__(self, rows: int, hidden: int, vocab_size: int, group: dist.ProcessGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight).contiguous()
        rank = dist.get_rank(self.group)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))] if rank == 0 else None
        dist.gather(local, parts, dst=dist.get_global_rank(self.group, 0), group=self.group)
        if rank != 0:
            return local[:, :0]
        return torch.cat(parts, dim=1)[:, : self.vocab_size]
