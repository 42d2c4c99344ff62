"""D's book of cached pages' checksums (``--kv-checksums``): a page of the radix cache is checked
again each time a prefix hit reuses it, so a page whose bytes changed since (a stray write, bad
memory) is evicted and recomputed instead of served.

A page's sums are its crc32 per kv head (``pd_common.head_checksums``) on EVERY tensor-parallel
rank (each rank's pool holds only its heads; followers answer over the TP command pipe,
``pd_common.rank_checksums``). They are recorded when its KV is known good and it enters the tree:
at the notice commit (P's sums of the delta were just verified) and when a finished request hands
D-computed pages to the cache (the ``CacheManager``'s ``on_cached`` hook). At pre-allocation the
matched prefix's pages are verified in order; at the first mismatch the lease is given back, that
page and everything below it leave the tree (``RadixCache.invalidate``) and the request is admitted
again with the shorter match, so P recomputes the rest. A page recorded while a rank could not
answer has no known-good sums: it counts as a mismatch at its next hit.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.distributed.group import TPRankDied
from engine.kvcache.cache_manager import CacheManager, KVLease
from pd_common.rank_checksums import RankSums, every_rank_sums
from telemetry import metrics as M

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

log = logging.getLogger("halfmoon.decode")

# one page's sums: per rank (rank order), its heads' crc32s
PageSums = tuple[tuple[int, ...], ...]


def _per_page(ranks: Sequence[RankSums], n: int) -> list[PageSums]:
    return [tuple(tuple(int(c) for c in r.sums[i]) for r in ranks) for i in range(n)]


class PageChecksums:
    """Page id -> its sums on every rank when it entered D's radix cache (scheduler thread only).

    A page id's entry is rewritten each time the page enters the tree again, so an entry left by a
    page that was evicted and reused is never compared with another request's KV.

    Args:
        runner: D's ModelRunner (rank 0's pool; its TP group reaches the other ranks' pools).
        timeout_s: how long a follower may take to answer a query.
    """

    def __init__(self, runner: ModelRunner, timeout_s: float = 10.0):
        self.runner = runner
        self.timeout_s = timeout_s
        self._sums: dict[int, PageSums | None] = {}  # None: recorded without sums (a rank did not answer)

    def record(self, pages: Sequence[int]) -> None:
        """``pages`` just entered the tree with KV known good (never raises: the ``on_cached`` hook)."""
        pages = [int(p) for p in pages]
        if not pages:
            return
        try:
            got: list[PageSums | None] = _per_page(every_rank_sums(self.runner, pages, self.timeout_s), len(pages))
        except (TimeoutError, TPRankDied, ValueError) as e:
            log.warning("KV checksums of %d cached pages not recorded (%s): they are evicted at their next "
                        "prefix hit", len(pages), e)
            got = [None] * len(pages)
        self._sums.update(zip(pages, got))

    def cut_bad_prefix(self, kv: CacheManager, lease: KVLease, tokens: Sequence[int]) -> bool:
        """Verify the pages of ``lease``'s cached prefix on every rank. False when all match (or
        none is cached); True after a mismatch (or a rank that could not answer): the lease was
        released and the bad page and what lies below it in the tree are gone (admit again for
        the shorter match)."""
        ps = kv.page_size
        if lease.pre_len == 0:
            return False
        pages = [int(s) // ps for s in kv.r2t.req_to_token[lease.row, 0:lease.pre_len:ps].tolist()]
        try:
            ranks = every_rank_sums(self.runner, pages, self.timeout_s)
        except (TimeoutError, TPRankDied, ValueError) as e:
            log.warning("KV checksums of a prefix hit of %d tokens not verified (%s); evicting it",
                        lease.pre_len, e)
            return self._cut(kv, lease, tokens, pages, 0)
        for i, (page, now) in enumerate(zip(pages, _per_page(ranks, len(pages)))):
            if page not in self._sums:
                continue
            want = self._sums[page]
            if want == now:
                continue
            if want is None:
                log.warning("cached page %d (logical page %d of a prefix hit of %d tokens) has no recorded "
                            "checksums; evicting it and what follows", page, i, lease.pre_len)
            else:
                r = next(k for k in range(len(now)) if now[k] != want[k])
                j = next(k for k in range(len(now[r])) if now[r][k] != want[r][k])
                head = ranks[r].head_start + j
                log.warning("KV checksum mismatch on cached page %d (logical page %d of a prefix hit of "
                            "%d tokens), kv head %d on rank %d: crc32 %08x, recorded %08x; evicting it "
                            "and what follows", page, i, lease.pre_len, head, ranks[r].rank, now[r][j], want[r][j])
            return self._cut(kv, lease, tokens, pages, i)
        return False

    def _cut(self, kv: CacheManager, lease: KVLease, tokens: Sequence[int], pages: list[int], i: int) -> bool:
        M.DECODE_KV_CHECKSUM_MISMATCHES.inc()
        kv.release(lease, None)
        kv.cache.invalidate(tokens, i)
        for p in pages[i:]:
            self._sums.pop(p, None)
        return True
