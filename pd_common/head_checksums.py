"""KV checksums per (page, kv head): the unit both sides of a PD pair can compare whatever their
tensor-parallel splits.

A page's sum for kv head ``h`` is the crc32 (zlib) of that head's bytes of the page in memory order:
layer 0 K (tokens in order, ``head_dim`` elements each), layer 0 V, layer 1 K, ... With one kv head
it is the crc32 of the whole page (a page_major page's byte range). A rank's pool holds a
contiguous range of kv heads, so a sum does not depend on which rank holds the head: P of TP a and
D of TP b compare head by head.

On the wire (``KVNotice.head_checksums``) the sums of the delta are one flat list, page-major:
entry ``i * kv_heads + h`` is sent page ``i``'s sum for kv head ``h`` (``kv_heads``: the model's
total, every rank's).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence

import torch

# global kv head -> crc32 of each page, in the page order of the call that computed them
HeadSums = dict[int, list[int]]


def head_checksums(kv_pool, pages: Sequence[int], heads: Iterable[int] | None = None) -> list[list[int]]:
    """crc32 of each (page, local kv head) of ``kv_pool``.

    Args:
        kv_pool: an ``engine.kvcache.kv_pool.KVPool`` (either layout; a CUDA pool is copied to the host).
        pages: physical page ids.
        heads: the pool's local kv head indices ``[0, kv_pool.num_kv_heads)`` to sum (None: all).
    Returns:
        ``[len(pages)][len(heads)]`` unsigned 32-bit ints.
    Raises:
        IndexError: a page or head out of range.
    """
    heads = list(range(kv_pool.num_kv_heads)) if heads is None else [int(h) for h in heads]
    bufs = [t for layer in range(kv_pool.num_layers) for t in (kv_pool.k_pages(layer), kv_pool.v_pages(layer))]
    out = []
    for p in pages:
        p = int(p)
        page = torch.stack([t[p] for t in bufs])                       # [2L, ps, kvh, hd]
        by_head = page[:, :, heads].permute(2, 0, 1, 3).contiguous()   # [heads, 2L, ps, hd]
        raw = by_head.cpu().view(torch.uint8).reshape(len(heads), -1).numpy()
        out.append([zlib.crc32(raw[i]) for i in range(len(heads))])
    return out


def by_head(sums: Sequence[Sequence[int]], heads: Sequence[int]) -> HeadSums:
    """``head_checksums``' ``[page][i]`` as ``{heads[i]: [crc of each page]}`` (``heads``: the
    global kv head of each local column)."""
    return {int(h): [int(row[i]) for row in sums] for i, h in enumerate(heads)}


class NoticeSums:
    """P's sums of one job's delta, gathered batch by batch (any completion order) and from every
    rank that wrote, then flattened for ``KVNotice.head_checksums``.

    A (page, head) already held keeps its first sum: under replication several P ranks hold a head,
    but one of them writes it (``head_slices.plan_rank_writes``), and that rank's sum is the one sent.
    """

    def __init__(self, num_heads: int):
        self.num_heads = num_heads
        self._sums: dict[tuple[int, int], int] = {}  # (logical page, global kv head) -> crc32

    def add(self, first_page: int, sums: Mapping[int, Sequence[int]]) -> None:
        """``sums[h][i]`` is logical page ``first_page + i``'s sum for kv head ``h``."""
        for h, crcs in sums.items():
            for i, crc in enumerate(crcs):
                self._sums.setdefault((first_page + i, int(h)), int(crc))

    def flat(self, first_page: int, end_page: int) -> list[int]:
        """Logical pages ``[first_page, end_page)``, page-major (the wire order).

        Raises:
            ValueError: some (page, head) has no sum (a rank's reply lacked it), naming the first.
        """
        out = []
        for page in range(first_page, end_page):
            for h in range(self.num_heads):
                crc = self._sums.get((page, h))
                if crc is None:
                    raise ValueError(f"no checksum of kv head {h} for logical page {page}")
                out.append(crc)
        return out


def mismatches(notice: Sequence[int], num_heads: int, head_start: int,
               sums: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(page index, global kv head) of every sum in ``sums`` (``[page][local head]`` of a rank
    holding heads ``[head_start, head_start + len(sums[i]))``) that differs from the notice's
    flat page-major list over ``num_heads`` heads. The caller checks the notice's length first."""
    return [(i, head_start + j) for i, row in enumerate(sums) for j, crc in enumerate(row)
            if int(notice[i * num_heads + head_start + j]) != int(crc)]
