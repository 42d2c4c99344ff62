"""The strided per-rank write the serving path used before the head-blocked one (kept for
bench/tp_transfer.py's comparison only): one put per (page, layer, K/V, token) row of a head slice,
since the pool is token-major inside a page and a head slice of a page is ``page_size`` strided
pieces per layer and K/V."""

from __future__ import annotations

from collections.abc import Sequence

from pd_common import PageShape, RankRegion, RankWrite, check_pages


def slice_descriptors(write: RankWrite, src: RankRegion, dst: RankRegion, shape: PageShape,
                      src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """(local address, remote address, bytes) puts moving ``write``'s heads of page ``src_pages[i]``
    (in ``src``) to ``dst_pages[i]`` (in ``dst``), in page order: one per page where both sides hold
    exactly the head range, else one per (page, layer, K/V, token) row.

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
    check_pages(src_pages, src, shape)
    check_pages(dst_pages, dst, shape)
    s_stride, d_stride = shape.stride(src.heads), shape.stride(dst.heads)
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
