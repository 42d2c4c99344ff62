"""A tensor-parallel worker's ranks, as rank 0 collects them at start-up: each follower's segment
descriptor (its first message on the reply pipe, ``pd_common/tp_rank.py``) and every rank's KV
region (rank order, with the kv heads it holds), which the worker publishes as ONE descriptor
(``transfer_svc/rank_regions.py``)."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

from engine.distributed.shard import plan_shard
from pd_common.tp_rank import local_region
from protos import registry_pb2
from transfer_svc.rank_regions import RankRegion


@dataclass
class Ranks:
    """``regions``: every rank's KV region, rank 0 first (one entry without TP); ``descriptors``:
    ranks 1..N-1's segment descriptors (empty without TP)."""

    regions: list[RankRegion] = field(default_factory=list)
    descriptors: list[registry_pb2.SegmentDescriptor] = field(default_factory=list)


def collect_ranks(runner, timeout_s: float = 120.0) -> Ranks:
    """Rank 0's own region and, under TP (``runner.tp`` set), each follower's descriptor and region.

    Raises:
        SystemExit: one ``error:`` line naming the rank that sent no descriptor within ``timeout_s``.
    """
    ranks = Ranks([local_region(runner)])
    if runner.tp is None:
        return ranks
    for r in range(1, runner.tp.size):
        try:
            data = runner.tp.replies(r).get(timeout=timeout_s)
        except queue.Empty:
            raise SystemExit(f"error: tensor-parallel rank {r} sent no segment descriptor "
                             f"within {timeout_s:g} s") from None
        desc = registry_pb2.SegmentDescriptor.FromString(data)
        ranks.descriptors.append(desc)
        region = desc.regions[0]
        lo, hi = plan_shard(runner.model_config, r, runner.tp.size).kv_heads
        ranks.regions.append(RankRegion(r, lo, hi, int(region.base), int(region.length)))
    return ranks
