"""The per-rank KV regions of a tensor-parallel worker's ONE segment descriptor.

A worker of N tensor-parallel ranks runs N UCP workers (one transfer engine per rank process), and
each rank's pool holds only its kv heads. Its descriptor lists every rank's region with the rank,
its kv-head range and that rank's UCP worker address (``registry.proto`` MemoryRegion); rank 0's
region keeps an empty ``worker_address`` (the descriptor's own). A descriptor without head ranges is
one rank holding every kv head (``rank_regions`` reads it that way).

A peer writes into rank s's region over an endpoint to rank s's UCP worker: ``rank_descriptor``
derives a single-rank descriptor (name ``<name>#rank<s>``, that worker address, that region; digest
recomputed after the whole descriptor's was checked), which ``TransferEngine.open_segment`` opens
like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos import registry_pb2
from transfer_svc.digest import descriptor_digest
from transfer_svc.types import DescriptorError


@dataclass(frozen=True)
class RankRegion:
    """One rank's KV shard as a peer addresses it: ``base`` (address in that rank's process),
    ``length`` bytes, kv heads ``[head_start, head_end)`` of the model's."""

    rank: int
    head_start: int
    head_end: int
    base: int
    length: int

    @property
    def heads(self) -> int:
        return self.head_end - self.head_start


def rank_regions(desc: registry_pb2.SegmentDescriptor) -> list[RankRegion]:
    """Every rank's KV region of ``desc`` in rank order (a single-rank descriptor: one, every head).

    Raises:
        DescriptorError: a rank appears twice, ranks are not ``0..N-1``, or the head ranges are
            empty or outside the layout's ``kv_heads``; a multi-rank descriptor whose layout is
            not page_major (the only layout per-rank writes address).
    """
    kv = desc.kv_layout
    if kv.tp_size <= 1 and not any(r.kv_head_end for r in desc.regions):
        if not desc.regions:
            return []
        r = desc.regions[0]
        return [RankRegion(0, 0, int(kv.kv_heads), int(r.base), int(r.length))]
    if kv.layout != "page_major":
        raise DescriptorError(f"segment {desc.name!r}: per-rank KV regions need the page_major layout, "
                              f"not {kv.layout!r}")
    out = sorted((RankRegion(int(r.rank), int(r.kv_head_start), int(r.kv_head_end), int(r.base),
                             int(r.length)) for r in desc.regions), key=lambda r: r.rank)
    if [r.rank for r in out] != list(range(len(out))) or len(out) != max(int(kv.tp_size), 1):
        raise DescriptorError(f"segment {desc.name!r}: regions of ranks {[r.rank for r in out]} "
                              f"for tp_size {kv.tp_size}")
    for r in out:
        if not 0 <= r.head_start < r.head_end <= kv.kv_heads:
            raise DescriptorError(f"segment {desc.name!r}: rank {r.rank} kv heads "
                                  f"[{r.head_start}, {r.head_end}) outside [0, {kv.kv_heads})")
    return out


def rank_descriptor(desc: registry_pb2.SegmentDescriptor, rank: int) -> registry_pb2.SegmentDescriptor:
    """A descriptor of rank ``rank``'s region alone, reachable at that rank's UCP worker; name
    ``<desc.name>#rank<rank>``. Check ``desc`` (``validate_descriptor``) before deriving from it.

    Raises:
        DescriptorError: ``desc`` has no region of that rank.
    """
    for r in desc.regions:
        if r.rank == rank:
            break
    else:
        raise DescriptorError(f"segment {desc.name!r} has no region of rank {rank}")
    out = registry_pb2.SegmentDescriptor(
        name=f"{desc.name}#rank{rank}", incarnation=desc.incarnation,
        worker_address=r.worker_address or desc.worker_address, host_id=desc.host_id, pid=desc.pid,
        pid_start_ticks=desc.pid_start_ticks)
    out.kv_layout.CopyFrom(desc.kv_layout)
    out.regions.add(base=r.base, length=r.length, rkey=r.rkey, location=r.location, rank=r.rank,
                    kv_head_start=r.kv_head_start, kv_head_end=r.kv_head_end)
    out.digest = descriptor_digest(out)
    return out


def tp_descriptor(rank0: registry_pb2.SegmentDescriptor, heads: list[tuple[int, int]],
                  followers: list[registry_pb2.SegmentDescriptor]) -> registry_pb2.SegmentDescriptor:
    """The worker's descriptor: rank 0's own (``rank0``, from ``TransferEngine.publish``) with its
    region's head range set and every follower's region appended (rank r = ``followers[r - 1]``,
    whose engine registered exactly its pool); ``heads[r]`` is rank r's kv-head range. The digest
    is recomputed over all of it.

    Raises:
        DescriptorError: a descriptor does not hold exactly one region, or ``heads`` does not have
            one range per rank.
    """
    if len(heads) != len(followers) + 1:
        raise DescriptorError(f"{len(heads)} head ranges for {len(followers) + 1} ranks")
    out = registry_pb2.SegmentDescriptor()
    out.CopyFrom(rank0)
    for rank, d in enumerate([rank0, *followers]):
        if len(d.regions) != 1:
            raise DescriptorError(f"rank {rank} registered {len(d.regions)} KV regions, not one")
    out.regions[0].kv_head_start, out.regions[0].kv_head_end = heads[0]
    for rank, d in enumerate(followers, start=1):
        r = d.regions[0]
        out.regions.add(base=r.base, length=r.length, rkey=r.rkey, location=r.location, rank=rank,
                        kv_head_start=heads[rank][0], kv_head_end=heads[rank][1],
                        worker_address=d.worker_address, pid=d.pid, pid_start_ticks=d.pid_start_ticks)
    out.digest = descriptor_digest(out)
    return out
