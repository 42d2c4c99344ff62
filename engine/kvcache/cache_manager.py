"""One KV lifecycle for every scheduler: admit -> lease -> (grow, commit) -> release.

The co-located scheduler, the prefill worker and the decode worker all hold a request's KV the
same way, so this file is the only place that writes the sequence out:

1. **admit**: match the prompt in the prefix cache (full pages only), lock the matched node,
   evict unlocked cache pages if the pool is short, allocate pages for the rest, and write the
   request's ``req_to_token`` row as ``[prefix slots (0..pre_len) | own slots (pre_len..alloc_len)]``.
   Anything that reads the new tokens' slots reads ``row[pre_len:]``, never ``row[:n]``.
2. **grow**: more slots at the end of the row (decode), filling the partly used last page first.
3. **commit**: a request that keeps running hands its full pages of committed tokens to the tree
   (duplicates freed, the row repointed at the tree's pages, the lock moved down the tree).
4. **release**: the committed tokens' full pages go to the tree (the tree keeps what it did not
   already hold), every other own page is freed unless the caller withholds it (pages a peer may
   still write go to the decode worker's quarantine), the prefix is unlocked, the row is freed.

Accounting invariant the caller keeps: free + evictable + locked + pages owned by leases (and by
whatever the caller withheld) == pool pages. The design follows SGLang's ``match_prefix`` /
``cache_unfinished_req`` / ``cache_finished_req`` split, with one lease type instead of three
request types each holding the same fields under other names.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from engine.kvcache.page_allocator import PageAllocator
from engine.kvcache.paging import page_slots, pages_for
from engine.kvcache.prefix_cache import NullPrefixCache, PrefixCache
from engine.kvcache.req_to_token_pool import ReqToTokenPool


@dataclass(eq=False)
class KVLease:
    """What one request holds of the KV memory.

    row: its ``req_to_token`` row. pre_len: tokens matched in the prefix cache at admission (a
    multiple of page_size). tree_len: tokens of the row the tree holds for it (>= pre_len; grows on
    ``commit``), locked through ``node``. own_pages: page ids the request owns, logical pages
    ``tree_len // page_size`` onwards, in order. alloc_len: slots written in the row.
    """

    row: int
    pre_len: int
    tree_len: int
    node: object
    own_pages: list[int] = field(default_factory=list)
    alloc_len: int = 0


class CacheManager:
    """Admission, growth, commit and release of KV leases over one pool.

    Args:
        allocator: the pool's page allocator.
        req_to_token: the request rows (int64 [rows, max_context] -> slot).
        prefix_cache: a ``PrefixCache`` (the radix cache), or None for ``NullPrefixCache``.
        on_evict: called with the number of pages evicted, each time the manager evicts (metrics).
        on_cached: called with the page ids a lease handed to the prefix cache (commit, release),
            while their KV is what the request wrote (the decode worker's page checksums).
    Not thread-safe: the scheduler thread owns it.

    A lease whose prefix was invalidated under it (``cache.detached(lease.node)``) hands nothing to
    the cache: its row names pages the tree no longer trusts.
    """

    def __init__(self, allocator: PageAllocator, req_to_token: ReqToTokenPool,
                 prefix_cache: PrefixCache | None = None, *,
                 on_evict: Callable[[int], object] | None = None,
                 on_cached: Callable[[list[int]], object] | None = None):
        self.alloc = allocator
        self.r2t = req_to_token
        self.cache: PrefixCache = prefix_cache if prefix_cache is not None else NullPrefixCache()
        self.page_size = allocator.page_size
        self._on_evict = on_evict
        self._on_cached = on_cached

    # ------------------------------------------------------------------ pages
    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens."""
        return pages_for(tokens, self.page_size)

    @property
    def available_pages(self) -> int:
        """Free pages plus the cache's evictable pages."""
        return self.alloc.num_free + self.cache.evictable_size()

    def ensure_free(self, pages: int) -> bool:
        """Evict unlocked cache pages until ``pages`` are free; False when even that is short."""
        if self.alloc.num_free < pages:
            evicted = self.cache.evict(pages - self.alloc.num_free)
            if evicted and self._on_evict is not None:
                self._on_evict(evicted)
        return self.alloc.num_free >= pages

    # ------------------------------------------------------------------ lifecycle
    def admit(self, tokens: Sequence[int], *, match_len: int, alloc_len: int,
              headroom_pages: int = 0) -> KVLease | None:
        """Take a row and the pages for ``alloc_len`` slots, reusing the cached prefix.

        Args:
            tokens: the request's token ids.
            match_len: how much of ``tokens`` may come from the cache (a prefill keeps the last
                token to compute: ``len - 1``; a decode worker matches the whole prompt).
            alloc_len: slots the row needs now (>= the matched prefix).
            headroom_pages: pages that must stay available after this admission (e.g. one per
                running request, so the next decode step does not have to preempt at once).
        Returns:
            The lease, or None when no row is free or the pages (after eviction) are short; then
            nothing is held and nothing was evicted unless the admission could fit.
        """
        row = self.r2t.alloc()
        if row is None:
            return None
        prefix, node = self.cache.match_prefix(tokens[:match_len])
        self.cache.inc_lock_ref(node)
        pre = prefix.numel()
        need = self.pages_for(alloc_len) - pre // self.page_size
        pages = None
        if need + headroom_pages <= self.available_pages and self.ensure_free(need):
            pages = self.alloc.alloc(need)
        if pages is None:
            self.cache.dec_lock_ref(node)
            self.r2t.free(row)
            return None
        self.r2t.write(row, 0, prefix)
        self.r2t.write(row, pre, page_slots(pages, self.page_size, alloc_len - pre))
        return KVLease(row=row, pre_len=pre, tree_len=pre, node=node, own_pages=pages,
                       alloc_len=alloc_len)

    def grow(self, lease: KVLease, new_len: int) -> bool:
        """Extend the row to ``new_len`` slots (evicting if short); False (nothing taken) when the
        pool cannot give the pages."""
        cur, ps = lease.alloc_len, self.page_size
        if new_len <= cur:
            return True
        if not self.ensure_free(self.pages_for(new_len) - self.pages_for(cur)):
            return False
        last = int(self.r2t.req_to_token[lease.row, cur - 1]) if cur % ps else None
        slots = self.alloc.alloc_slots(cur, new_len, last)  # fills the partly used last page first
        if slots is None:
            return False
        self.r2t.write(lease.row, cur, slots)
        new = slots.to("cpu")
        lease.own_pages.extend((new[new % ps == 0] // ps).tolist())  # a fresh page shows by its first slot
        lease.alloc_len = new_len
        return True

    def commit(self, lease: KVLease, tokens: Sequence[int]) -> None:
        """Hand the full pages of ``tokens`` (committed: KV written at ``row[:len(tokens)]``) to the
        tree while the request keeps running: its duplicates are freed, the row points at the
        tree's pages, the lock moves to the new node, and the lease owns only pages after them."""
        ps = self.page_size
        full = len(tokens) // ps * ps
        if not self.cache.enabled or full <= lease.tree_len or self.cache.detached(lease.node):
            return
        slots = self.r2t.req_to_token[lease.row, :full].clone()
        n_dup = self.cache.insert(tokens[:full], slots)
        first = lease.tree_len // ps
        dup = [p for i, p in enumerate(lease.own_pages, start=first) if i < n_dup // ps]
        if dup:
            self.alloc.free(dup)
        if self._on_cached is not None:
            self._on_cached([p for i, p in enumerate(lease.own_pages, start=first)
                             if n_dup // ps <= i < full // ps])
        new_slots, node = self.cache.match_prefix(tokens[:full])
        self.cache.inc_lock_ref(node)
        self.cache.dec_lock_ref(lease.node)
        lease.node = node
        self.r2t.write(lease.row, 0, new_slots)
        lease.own_pages = lease.own_pages[full // ps - first:]
        lease.tree_len = full

    def release(self, lease: KVLease, tokens: Sequence[int] | None = None,
                withhold: Collection[int] = ()) -> None:
        """End the lease.

        Args:
            tokens: committed tokens (KV written at ``row[:len(tokens)]``) whose full pages the tree
                may keep; None keeps nothing (the KV may be incomplete or overwritten).
            withhold: own pages not to free (the caller takes them over, e.g. a quarantine).
        """
        ps = self.page_size
        first = lease.tree_len // ps
        kept = range(0)
        if (tokens is not None and len(tokens) // ps * ps > lease.tree_len
                and not self.cache.detached(lease.node)):
            kept = self.cache.insert_finished(tokens, self.r2t.req_to_token[lease.row], first)
            if kept and self._on_cached is not None:
                self._on_cached(lease.own_pages[kept.start - first:kept.stop - first])
        held = set(withhold)
        free = [p for i, p in enumerate(lease.own_pages, start=first) if i not in kept and p not in held]
        if free:
            self.alloc.free(free)
        lease.own_pages = []
        self.cache.dec_lock_ref(lease.node)
        lease.node = None
        self.r2t.free(lease.row)
