"""D's book of cached pages' checksums (``--kv-checksums``): a page of the radix cache is checked
again each time a prefix hit reuses it, so a page whose bytes changed since (a stray write, bad
memory) is evicted and recomputed instead of served.

A page's crc32 (``pd_common.protocol.page_checksums``) is recorded when its KV is known good and it
enters the tree: at the notice commit (P's checksums of the delta were just verified) and when a
finished request hands D-computed pages to the cache (the ``CacheManager``'s ``on_cached`` hook).
At pre-allocation the matched prefix's pages are verified in order; at the first mismatch the
lease is given back, that page and everything below it leave the tree (``RadixCache.invalidate``)
and the request is admitted again with the shorter match, so P recomputes the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from engine.kvcache.cache_manager import CacheManager, KVLease
from pd_common.protocol import page_checksums
from telemetry import metrics as M

log = logging.getLogger("halfmoon.decode")


class PageChecksums:
    """Page id -> crc32 of the KV it held when it entered D's radix cache (scheduler thread only).

    A page id's entry is rewritten each time the page enters the tree again, so an entry left by a
    page that was evicted and reused is never compared with another request's KV.
    """

    def __init__(self, kv_pool):
        self.pool = kv_pool
        self._sums: dict[int, int] = {}

    def record(self, pages: Sequence[int]) -> None:
        """``pages`` just entered the tree with KV known good."""
        pages = [int(p) for p in pages]
        self._sums.update(zip(pages, page_checksums(self.pool, pages)))

    def cut_bad_prefix(self, kv: CacheManager, lease: KVLease, tokens: Sequence[int]) -> bool:
        """Verify the pages of ``lease``'s cached prefix. False when all match (or none is cached);
        True after a mismatch: the lease was released and the bad page and what lies below it in
        the tree are gone (admit again for the shorter match)."""
        ps = kv.page_size
        if lease.pre_len == 0:
            return False
        pages = [int(s) // ps for s in kv.r2t.req_to_token[lease.row, 0:lease.pre_len:ps].tolist()]
        for i, (page, crc) in enumerate(zip(pages, page_checksums(self.pool, pages))):
            want = self._sums.get(page)
            if want is None or want == crc:
                continue
            log.warning("KV checksum mismatch on cached page %d (logical page %d of a prefix hit of "
                        "%d tokens): crc32 %08x, recorded %08x; evicting it and what follows",
                        page, i, lease.pre_len, crc, want)
            M.DECODE_KV_CHECKSUM_MISMATCHES.inc()
            kv.release(lease, None)
            kv.cache.invalidate(tokens, i)
            for p in pages[i:]:
                self._sums.pop(p, None)
            return True
        return False
