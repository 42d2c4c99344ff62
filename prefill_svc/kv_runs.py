"""Page runs and transfer descriptors: how a request's delta becomes a few large writes.

P writes its *logical* pages ``pre_len/page_size ...`` (physical ids ``src_pages``) into D's
physical pages ``dst_pages`` (the delta only, in the same order). Consecutive pairs whose source
and destination ids both grow by one form a *run*; each run becomes one descriptor per KV buffer
(layer_major: per layer per K/V) or, in a page_major pool where a run is one byte range for all
layers, ONE descriptor (a 4-page run of a 32-layer model: 64 -> 1); every descriptor of a chunk goes
in one submitted batch. Few large writes matter because each transport put has a fixed cost (about
1 µs over shared memory), so a send costs O(runs), not O(pages). Same idea as SGLang's
``group_concurrent_contiguous`` (disaggregation/common/utils.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PageRun:
    """``length`` pages: source ``src .. src+length-1`` -> destination ``dst .. dst+length-1``."""

    src: int
    dst: int
    length: int


def merge_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[PageRun]:
    """Split parallel page lists into maximal runs contiguous on both sides.

    Args:
        src_pages, dst_pages: page ids (ints), equal length N; pair i moves src_pages[i] to
            dst_pages[i].
    Returns:
        Runs in input order; their lengths sum to N (an empty list for N == 0).
    Raises:
        ValueError: the lists differ in length.
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    runs: list[PageRun] = []
    for s, d in zip(src_pages, dst_pages):
        s, d = int(s), int(d)
        if runs:
            last = runs[-1]
            if s == last.src + last.length and d == last.dst + last.length:
                runs[-1] = PageRun(last.src, last.dst, last.length + 1)
                continue
        runs.append(PageRun(s, d, 1))
    return runs


@dataclass(frozen=True)
class PoolGeometry:
    """Where pages live in one side's KV pool (mirrors ``registry.proto`` ``KVLayout``).

    layout "layer_major": ``buffer_addrs`` = [K_0, V_0, K_1, V_1, ...]; page p of buffer b starts at
        ``buffer_addrs[b] + p * page_bytes`` (pages of one buffer are contiguous, so a run is one range).
    layout "page_major": one region; page p of buffer b starts at
        ``buffer_addrs[0] + p * page_stride_bytes + b * page_bytes``; when a page's buffers are
        back to back (``page_stride_bytes == num_buffers * page_bytes``, as ``engine.kvcache.kv_pool.KVPool``
        lays them out) a run is one range for all buffers at once.
    Units: addresses and ``*_bytes`` in bytes, ``num_pages`` in pages, ``page_size`` in tokens.
    ``dtype`` ("float32", "bfloat16", ...) and ``page_size`` are compared only when both sides set
    them ("" / 0 = unknown): bfloat16 and float16 pages have the same size, so ``page_bytes`` alone
    cannot tell them apart.
    """

    layout: str
    buffer_addrs: tuple[int, ...]
    page_bytes: int
    num_pages: int
    page_stride_bytes: int = 0
    num_buffers: int = 0  # buffers per page, 2 * layers (page_major needs it)
    dtype: str = ""
    page_size: int = 0

    @classmethod
    def from_layout(cls, kv_layout) -> "PoolGeometry":
        """From a ``registry_pb2.KVLayout``."""
        return cls(kv_layout.layout, tuple(kv_layout.buffer_addrs), int(kv_layout.page_bytes),
                   int(kv_layout.num_pages), int(kv_layout.page_stride_bytes),
                   2 * int(kv_layout.num_layers), kv_layout.dtype, int(kv_layout.page_size))

    @property
    def contiguous_pages(self) -> bool:
        """page_major with a page's buffers back to back: a run of pages is one byte range."""
        return self.layout == "page_major" and self.page_stride_bytes == self.num_buffers * self.page_bytes

    def compatible(self, other: "PoolGeometry") -> str | None:
        """None when pages can be copied byte for byte between the two pools, else the reason, which
        names the worker flag that differs (``self`` is "here", ``other`` "the peer")."""
        if self.layout not in ("layer_major", "page_major"):
            return f"unknown KV layout {self.layout!r}"
        if self.layout != other.layout:
            return (f"KV layout {self.layout} here but {other.layout} on the peer (prefill and decode "
                    f"need the same --kv-layout)")
        if self.dtype and other.dtype and self.dtype != other.dtype:
            return (f"KV dtype {self.dtype} here but {other.dtype} on the peer (prefill and decode "
                    f"need the same --dtype)")
        if self.page_size and other.page_size and self.page_size != other.page_size:
            return (f"page size {self.page_size} tokens here but {other.page_size} on the peer (prefill "
                    f"and decode need the same --page-size)")
        if self.page_bytes != other.page_bytes:
            return (f"page_bytes {self.page_bytes} here but {other.page_bytes} on the peer (prefill and "
                    f"decode need the same --model, --dtype and --page-size)")
        if self.layout == "layer_major" and len(self.buffer_addrs) != len(other.buffer_addrs):
            return (f"{len(self.buffer_addrs)} buffers here but {len(other.buffer_addrs)} on the peer "
                    f"(prefill and decode need the same --model)")
        if self.layout == "page_major" and self.num_buffers != other.num_buffers:
            return (f"{self.num_buffers} buffers per page here but {other.num_buffers} on the peer "
                    f"(prefill and decode need the same --model)")
        return None

    def ranges(self, page: int, length: int, merge: bool = True) -> list[tuple[int, int]]:
        """(address, bytes) ranges covering pages ``page .. page+length-1`` in every buffer.

        layer_major: one range per buffer. page_major: one range per page (``num_buffers *
        page_bytes`` each), merged into one range for the whole run when ``merge`` and the pages are
        back to back (:attr:`contiguous_pages`).
        """
        if self.layout == "layer_major":
            return [(b + page * self.page_bytes, length * self.page_bytes) for b in self.buffer_addrs]
        if self.layout == "page_major":
            base = self.buffer_addrs[0]
            per_page = self.num_buffers * self.page_bytes
            if merge and self.contiguous_pages:
                return [(base + page * self.page_stride_bytes, length * per_page)]
            return [(base + p * self.page_stride_bytes, per_page) for p in range(page, page + length)]
        raise ValueError(f"unknown KV layout {self.layout!r}")


def descriptors(runs: Sequence[PageRun], src: PoolGeometry,
                dst: PoolGeometry) -> list[tuple[int, int, int]]:
    """(local address, remote address, bytes) writes for ``runs``: one per run per buffer
    (layer_major: ``2 * num_layers`` per run), or ONE per run when both page_major pools keep a page's
    buffers back to back (else one per page).

    Raises:
        ValueError: the geometries differ (see ``PoolGeometry.compatible``) or a page id is out of
            range on either side.
    """
    why = src.compatible(dst)
    if why:
        raise ValueError(f"KV pools differ: {why}")
    out: list[tuple[int, int, int]] = []
    for r in runs:
        if r.src < 0 or r.src + r.length > src.num_pages:
            raise ValueError(f"source pages {r.src}..{r.src + r.length - 1} outside the pool")
        if r.dst < 0 or r.dst + r.length > dst.num_pages:
            raise ValueError(f"destination pages {r.dst}..{r.dst + r.length - 1} outside the pool")
        merge = src.contiguous_pages and dst.contiguous_pages  # else page by page on both sides
        for (sa, n), (da, m) in zip(src.ranges(r.src, r.length, merge), dst.ranges(r.dst, r.length, merge),
                                    strict=True):
            assert n == m
            out.append((sa, da, n))
    return out
