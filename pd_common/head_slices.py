"""Which P rank writes which kv heads into which D rank, and the puts of one such write.

Under tensor parallelism each rank's page_major pool holds only its kv heads, laid out
``[pages, layers, K/V, page_size, heads, head_dim]`` (``engine.kvcache.kv_pool``), token-major
inside a page. P of TP a writes into D of TP b by kv-head ranges (transfer_svc/rank_regions.py
``RankRegion``): every head of a D rank comes from the lowest P rank holding it (a replicated head
is sent once per D rank holding it, not once per P replica).

Every write moves ONE contiguous block per page, ``[layers, K/V, page_size, hi - lo, head_dim]``
of heads ``[lo, hi)`` (``BlockWrite``):

* source: the whole P page when ``[lo, hi)`` is all of the P rank's heads, else the block gathered
  into the P rank's registered staging area (``pd_common.staged_writes``);
* destination: the whole D page when ``[lo, hi)`` is all of the D rank's heads, else the block at
  byte offset ``stride(lo - d.head_start)`` of D's page: the page is then *head-blocked* (its blocks
  in head order, each token-major) until D rewrites it token-major (``pd_common.head_blocks``)
  before anything reads it.

So a write is one descriptor per page (the transfer engine coalesces page runs contiguous on both
sides). The strided alternative, one put per (page, layer, K/V, token) row of the slice, measured
40-75x slower (bench/tp_transfer.py keeps it for comparison).
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


def head_cuts(plan: Sequence[RankWrite]) -> list[int]:
    """The kv-head boundaries of ``plan``'s writes, sorted (``[0, ..., kv_heads]``): a D rank whose
    heads an inner cut splits receives its pages head-blocked at those cuts (``head_blocks``)."""
    return sorted({w.head_start for w in plan} | {w.head_end for w in plan})


@dataclass(frozen=True)
class BlockWrite:
    """How ``write`` moves each page: one block of ``block_bytes``.

    ``staged``: the heads are not all of the P rank's, so the P rank gathers them into staging first
    (``src_head_offset``: the first one's index in its pool). ``blocked``: not all of the D rank's
    heads, so the block lands at ``dst_offset`` bytes into D's page and D unblocks the page."""

    write: RankWrite
    staged: bool
    blocked: bool
    block_bytes: int
    dst_offset: int
    src_head_offset: int


def block_write(write: RankWrite, src: RankRegion, dst: RankRegion, shape: PageShape) -> BlockWrite:
    """``write`` from ``src`` into ``dst`` as one block per page.

    Raises:
        ValueError: the head range is empty or not inside both regions.
    """
    lo, hi = write.head_start, write.head_end
    for r in (src, dst):
        if not r.head_start <= lo < hi <= r.head_end:
            raise ValueError(f"kv heads [{lo}, {hi}) outside rank {r.rank}'s [{r.head_start}, {r.head_end})")
    return BlockWrite(write, (lo, hi) != (src.head_start, src.head_end), (lo, hi) != (dst.head_start, dst.head_end),
                      shape.stride(hi - lo), shape.stride(lo - dst.head_start), lo - src.head_start)


def check_pages(pages: Sequence[int], region: RankRegion, shape: PageShape) -> None:
    """Raises ValueError naming the rank when a page of ``pages`` lies outside ``region``."""
    n = region.length // shape.stride(region.heads)
    if any(not 0 <= int(p) < n for p in pages):
        raise ValueError(f"page outside rank {region.rank}'s region of {n} pages")


def block_descriptors(bw: BlockWrite, src: RankRegion, dst: RankRegion, shape: PageShape,
                      src_pages: Sequence[int], dst_pages: Sequence[int],
                      staging_addr: int | None = None) -> list[tuple[int, int, int]]:
    """(local address, remote address, bytes): one per page, ``src_pages[i]`` (in ``src``; block
    ``i`` of the staging area at ``staging_addr`` when ``bw.staged``) to ``dst_pages[i]`` (in
    ``dst``), in page order.

    Raises:
        ValueError: the page lists differ in length, a page lies outside its region, or a staged
            write has no ``staging_addr``.
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    check_pages(src_pages, src, shape)
    check_pages(dst_pages, dst, shape)
    n, d_stride = bw.block_bytes, shape.stride(dst.heads)
    remote = [dst.base + int(d) * d_stride + bw.dst_offset for d in dst_pages]
    if bw.staged:
        if staging_addr is None:
            raise ValueError(f"kv heads [{bw.write.head_start}, {bw.write.head_end}) of rank {src.rank} need staging")
        return [(staging_addr + i * n, r, n) for i, r in enumerate(remote)]
    s_stride = shape.stride(src.heads)
    return [(src.base + int(s) * s_stride, r, n) for s, r in zip(src_pages, remote)]
