"""Which P rank writes which kv heads into which D rank, and the puts of one such write.

Under tensor parallelism each rank's page_major pool holds only its kv heads, laid out
``[pages, layers, K/V, page_size, heads, head_dim]`` (``engine.kvcache.kv_pool``). P of TP a writes
into D of TP b by kv-head ranges (transfer_svc/rank_regions.py ``RankRegion``): every head of a D
rank comes from the lowest P rank holding it (a replicated head is sent once per D rank holding
it, not once per P replica).

A write whose head range is the whole shard on both sides (P TP=2 -> D TP=2 with the same split)
moves whole pages, one put per page (the transfer engine merges page runs contiguous on both sides
into one put). Otherwise the heads of one token row are contiguous but rows are not: one put per
(page, layer, K/V, token) of ``heads * head_dim`` elements — the pool is token-major inside a page,
so a head slice is ``page_size`` strided pieces (a head-major page would make it one put per
(page, layer, K/V), at the cost of the attention kernels' views).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transfer_svc.rank_regions import RankRegion


@dataclass(frozen=True)
class PageShape:
    """A page's shape common to every rank of both sides: layers, tokens per page, head_dim, and
    bytes per element."""

    num_layers: int
    page_size: int
    head_dim: int
    itemsize: int

    @classmethod
    def from_layout(cls, kv_layout) -> "PageShape":
        """From a ``registry_pb2.KVLayout`` (page_bytes over its ``kv_heads``)."""
        per_elem = int(kv_layout.page_size) * int(kv_layout.kv_heads) * int(kv_layout.head_dim)
        return cls(int(kv_layout.num_layers), int(kv_layout.page_size), int(kv_layout.head_dim),
                   int(kv_layout.page_bytes) // per_elem)

    def row_bytes(self, heads: int) -> int:
        """One token's K (or V) of ``heads`` kv heads in one layer."""
        return heads * self.head_dim * self.itemsize

    def stride(self, heads: int) -> int:
        """One whole page (every layer's K and V) of a pool of ``heads`` kv heads."""
        return 2 * self.num_layers * self.page_size * self.row_bytes(heads)


@dataclass(frozen=True)
class RankWrite:
    """P rank ``src_rank`` writes kv heads ``[head_start, head_end)`` into D rank ``dst_rank``."""

    src_rank: int
    dst_rank: int
    head_start: int
    head_end: int


def plan_rank_writes(src: Sequence[RankRegion], dst: Sequence[RankRegion]) -> list[RankWrite]:
    """Every (P rank, D rank, head range) write that fills each D rank's heads once.

    Raises:
        ValueError: a head of some D rank is held by no P rank (the pools' kv heads differ).
    """
    out: list[RankWrite] = []
    for d in dst:
        h = d.head_start
        while h < d.head_end:
            holders = [s for s in src if s.head_start <= h < s.head_end]
            if not holders:
                raise ValueError(f"kv head {h} of decode rank {d.rank} is held by no prefill rank")
            s = min(holders, key=lambda r: r.rank)
            end = min(s.head_end, d.head_end)
            out.append(RankWrite(s.rank, d.rank, h, end))
            h = end
    return out


def slice_descriptors(write: RankWrite, src: RankRegion, dst: RankRegion, shape: PageShape,
                      src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """(local address, remote address, bytes) puts moving ``write``'s heads of page ``src_pages[i]``
    (in ``src``) to ``dst_pages[i]`` (in ``dst``), in page order.

    Raises:
        ValueError: the page lists differ in length, a page lies outside its region, or the head
            range is not inside both regions.
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    lo, hi = write.head_start, write.head_end
    for r in (src, dst):
        if not r.head_start <= lo < hi <= r.head_end:
            raise ValueError(f"kv heads [{lo}, {hi}) outside rank {r.rank}'s [{r.head_start}, {r.head_end})")
    s_stride, d_stride = shape.stride(src.heads), shape.stride(dst.heads)
    for pages, r, stride in ((src_pages, src, s_stride), (dst_pages, dst, d_stride)):
        if any(not 0 <= int(p) < r.length // stride for p in pages):
            raise ValueError(f"page outside rank {r.rank}'s region of {r.length // stride} pages")
    if (lo, hi) == (src.head_start, src.head_end) == (dst.head_start, dst.head_end):
        return [(src.base + int(s) * s_stride, dst.base + int(d) * d_stride, s_stride)
                for s, d in zip(src_pages, dst_pages)]
    s_row, d_row = shape.row_bytes(src.heads), shape.row_bytes(dst.heads)
    n = shape.row_bytes(hi - lo)
    s_off, d_off = shape.row_bytes(lo - src.head_start), shape.row_bytes(lo - dst.head_start)
    rows = range(2 * shape.num_layers * shape.page_size)  # (layer, K/V, token) rows, in memory order
    out = []
    for s, d in zip(src_pages, dst_pages):
        sa, da = src.base + int(s) * s_stride + s_off, dst.base + int(d) * d_stride + d_off
        out.extend((sa + i * s_row, da + i * d_row, n) for i in rows)
    return out
