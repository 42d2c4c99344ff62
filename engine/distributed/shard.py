"""Which part of the model one tensor-parallel rank holds.

Heads are split by GQA group so each rank's attention is self-contained (its q heads read only its
own kv heads):

* ``kv_heads >= tp``: the kv heads are split into ``tp`` contiguous ranges as evenly as possible
  (sizes differ by at most one when ``tp`` does not divide them: SmolLM2's 3 kv heads on TP=2 give
  ranks 2 and 1), and each rank takes the q heads of its kv heads. Uneven shards cost balance (the
  larger rank computes more attention), never correctness.
* ``kv_heads < tp``: ``tp`` must be a multiple of ``kv_heads``; each kv head is replicated on
  ``tp / kv_heads`` ranks that split its q heads (as SGLang and vLLM replicate kv heads).

The MLP's intermediate columns are split as evenly as possible; the vocabulary is split into
``ceil(vocab / tp)`` rows per rank, the last rank's tail padded with zero rows.
"""

from __future__ import annotations

import dataclasses

from engine.config import ModelConfig
from engine.errors import InvalidRequestError


def even_split(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` when ``n`` items go into ``parts`` contiguous ranges whose
    sizes differ by at most one (the first ``n % parts`` ranges are one longer)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


@dataclasses.dataclass(frozen=True)
class TPShard:
    """One rank's slice of a model: ranges are ``[start, stop)`` in heads, columns or vocab rows."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]  # rows this rank's embedding holds, ``vocab_per_rank`` long (may pass vocab_size)
    vocab_size: int

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def vocab_per_rank(self) -> int:
        return self.vocab[1] - self.vocab[0]

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with this rank's head, intermediate and vocabulary sizes (what its modules hold)."""
        return dataclasses.replace(cfg, num_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.intermediate[1] - self.intermediate[0],
                                   vocab_size=self.vocab_per_rank)


def check_tp_size(cfg: ModelConfig, tp: int) -> None:
    """Raises InvalidRequestError(field="tp") when ``cfg``'s heads cannot be split over ``tp`` ranks."""
    h, kv = cfg.num_heads, cfg.num_kv_heads
    if tp < 1:
        raise InvalidRequestError("tp", f"must be >= 1, got {tp}")
    if tp > kv and (tp % kv or (h // kv) < tp // kv):
        raise InvalidRequestError("tp", f"{tp} ranks cannot share the model's {kv} kv heads ({h} q heads): "
                                  f"with fewer kv heads than ranks, tp must be a multiple of {kv} and at most {h}")
    if cfg.intermediate_size < tp:
        raise InvalidRequestError("tp", f"{tp} ranks exceed the MLP's {cfg.intermediate_size} columns")


def plan_shard(cfg: ModelConfig, rank: int, tp: int) -> TPShard:
    """Rank ``rank``'s shard of ``cfg`` on ``tp`` ranks. Raises as :func:`check_tp_size`; ValueError
    for a rank outside ``[0, tp)``."""
    check_tp_size(cfg, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside [0, {tp})")
    h, kv = cfg.num_heads, cfg.num_kv_heads
    group = h // kv
    if kv >= tp:
        k0, k1 = even_split(kv, tp, rank)
        q = (k0 * group, k1 * group)
    else:
        per_head = tp // kv
        k0 = rank // per_head
        k1 = k0 + 1
        g0, g1 = even_split(group, per_head, rank % per_head)
        q = (k0 * group + g0, k0 * group + g1)
    vp = -(-cfg.vocab_size // tp)
    return TPShard(rank=rank, size=tp, q_heads=q, kv_heads=(k0, k1),
                   intermediate=even_split(cfg.intermediate_size, tp, rank),
                   vocab=(rank * vp, (rank + 1) * vp), vocab_size=cfg.vocab_size)
