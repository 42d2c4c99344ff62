"""Paged radix (prefix) cache: a radix tree over token ids whose edges are whole KV pages.

Design after SGLang's ``mem_cache/radix_cache.py`` (page-aligned keys, per-node lock refs along the
path to the root, LRU eviction of unlocked leaves), written for halfmoon's memory model:

* a page allocator owns ``num_pages`` pages of ``page_size`` tokens; slot = page * page_size + offset;
* ``req_to_token[row, pos] -> slot`` (int64), and position ``pos`` of a request always lives at offset
  ``pos % page_size`` of its page, so the slots of a page-aligned prefix are whole pages;
* a node's ``value`` holds the slots of its ``key`` tokens; the tree *owns* those pages until it
  evicts them (then it hands the page ids back through ``free_pages``).

Only full pages are cached: ``match_prefix`` and ``insert`` look at ``len(tokens) // page_size``
pages and ignore a partial last page. Sizes are counted in pages. A page of the tree is
*protected* while some node on or below it is locked (``lock_ref > 0``), otherwise *evictable*.
Accounting invariant the caller keeps (``check_invariants`` verifies it when given the numbers):

    free pages + evictable_size() + protected_size() + pages owned by running requests = num_pages

Usage (one request; ``alloc`` is ``engine.kvcache.page_allocator.PageAllocator``, ``r2t`` the
``ReqToTokenPool``, ``cache = RadixCache(page_size, alloc)``; evicted pages go to ``alloc.free``)::

    # 1. match + lock. A local prefill keeps >= 1 token to compute (it needs the last logits);
    #    decode in PD matches the whole prompt (a full hit moves 0 pages).
    prefix_slots, node = cache.match_prefix(prompt[: len(prompt) - 1])   # int64 [pre_len], CPU
    pre_len = prefix_slots.numel()                                       # multiple of page_size
    cache.inc_lock_ref(node)
    # 2. alloc the delta, positions [pre_len, seq_len); evict unlocked leaves if the pool is short
    need = alloc.pages_needed(pre_len, seq_len)
    if alloc.num_free < need:
        cache.evict(need - alloc.num_free)
    delta = alloc.alloc_slots(pre_len, seq_len, None)   # None: still short -> unlock, queue or
                                                        # ResourceExhaustedError if it never fits
    r2t.write(row, 0, prefix_slots); r2t.write(row, pre_len, delta)
    # 3. extend: forward with out_cache_loc = r2t.req_to_token[row, pre_len:seq_len]; decode ...
    # 4. insert committed tokens only (KV written). At the end of a request the last sampled token
    #    has no KV: kv_len = len(prompt) + len(output) - 1, committed = (prompt + output)[:kv_len]
    slots = r2t.slots(row, 0, kv_len)
    n_dup = cache.insert(committed, slots)   # tokens [0, n_dup) were already in the tree
    # 5. free duplicates: our pages in [pre_len, n_dup) duplicate the tree's; the tree now owns
    #    [n_dup, kv_len // page_size * page_size); the partial tail page(s) stay ours to free.
    alloc.free_slots(slots[pre_len:n_dup])
    alloc.free_slots(r2t.slots(row, kv_len // page_size * page_size, allocated_len))
    # (4-5 in one call: kept = cache.insert_finished(committed, r2t.slots(row, 0, allocated_len),
    #  pre_len // page_size) -> own logical pages now in the tree; free the others)
    # 6. unlock the prefix matched in step 1 (then free the request row)
    cache.dec_lock_ref(node)

For a request that keeps running (chunked prefill, or caching a decode in progress): insert the
committed tokens and free the duplicates [pre_len, n_dup) as in 5, then
``new_slots, new_node = match_prefix(committed)``, ``inc_lock_ref(new_node)``, ``dec_lock_ref(node)``,
write ``new_slots`` into ``req_to_token[row, :len(new_slots)]`` (it replaces the freed duplicates),
and continue with ``pre_len = len(new_slots)``; the request owns only its pages from there on.

Events: with ``enable_events=True`` each page also carries the chained ``engine.kvcache.page_hash`` key of
its prefix (stable across processes and restarts; the tree's own lookups compare token ids and
never hash), and the tree records ``CacheEvent``s (inserted / evicted page ranges with their
hashes) for KV-aware routing, read with ``drain_events()``. Without it no hashing is done.

Invalidation: ``invalidate(tokens, page)`` takes a page whose KV cannot be trusted, and everything
below it, out of the tree. Unlocked nodes are freed at once; a locked one is *detached*: no match
finds it any more, its pages stay protected while requests hold it and are freed when its last
lock drops, and a lease locked on it must insert nothing (``detached(node)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.kvcache import radix_audit
from engine.kvcache.page_hash import ROOT_HASH, page_hash
from engine.kvcache.radix_node import CacheEvent, CacheStats, PageFreer, TreeNode
from engine.kvcache.radix_removal import RadixRemoval

__all__ = ["CacheEvent", "CacheStats", "PageFreer", "RadixCache", "TreeNode"]


class RadixCache(RadixRemoval):
    """Radix tree over page-aligned token prefixes; see the module docstring for usage.

    Args:
        page_size: tokens per page (>= 1).
        free_pages: where evicted pages go: an object with ``free(page_ids)`` (the page allocator)
            or a callable taking ``page_ids``; page_ids is a 1-D int64 tensor.
        enable_events: keep page hashes and record ``CacheEvent``s for ``drain_events()`` (costs
            one blake2b per inserted page; drain regularly, the list grows until drained).
        seed: page-hash seed (``engine.kvcache.page_hash.ROOT_HASH`` by default).
    Not thread-safe: call it from the scheduler thread only.
    """

    enabled = True  # engine.kvcache.prefix_cache.PrefixCache; the null cache says False

    def __init__(self, page_size: int, free_pages: PageFreer | Callable[[torch.Tensor], None],
                 *, enable_events: bool = False, seed: int = ROOT_HASH):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._free = free_pages.free if hasattr(free_pages, "free") else free_pages
        if not callable(self._free):
            raise TypeError("free_pages must have free(page_ids) or be callable")
        self.enable_events = enable_events
        self.seed = seed
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget everything WITHOUT freeing pages (use at start-up or after the pool is rebuilt)."""
        self.root = TreeNode(key=[], value=torch.empty(0, dtype=torch.int64), hashes=[], start=0)
        self.root.lock_ref = 1  # never evicted, never counted
        self._evictable = 0
        self._protected = 0
        self._clock = 0
        self._events: list[CacheEvent] = []
        self.detached_tops: list[TreeNode] = []  # invalidated while locked (see invalidate)
        self.inserted_pages_total = 0
        self.evicted_pages_total = 0

    def evictable_size(self) -> int:
        """Pages in unlocked nodes (freeable by ``evict`` once their subtree is gone)."""
        return self._evictable

    def protected_size(self) -> int:
        """Pages in locked nodes (on the path of some in-use prefix)."""
        return self._protected

    def total_size(self) -> int:
        """Pages held by the tree."""
        return self._evictable + self._protected

    # ------------------------------------------------------------------ match
    def match_prefix(self, tokens: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached page-aligned prefix of ``tokens``.

        Args:
            tokens: token ids (list of ints or a 1-D integer tensor).
        Returns:
            (slots, node): slots is int64 [pre_len] with pre_len a multiple of page_size (0 on a
            miss); node is the tree node ending exactly at pre_len (the root on a miss), to pass to
            ``inc_lock_ref``/``dec_lock_ref``. Marks the matched nodes as recently used; may split a
            node so that ``node`` ends at pre_len.
        """
        key = self._as_list(tokens)
        n = len(key) // self.page_size * self.page_size
        node, pos = self._walk(key, n, split=True)
        # gather values along the path root -> node
        parts: list[torch.Tensor] = []
        cur = node
        while cur is not self.root:
            parts.append(cur.value)
            cur = cur.parent
        if not parts:
            return torch.empty(0, dtype=torch.int64), node
        parts.reverse()
        return torch.cat(parts), node

    # ------------------------------------------------------------------ insert
    def insert(self, tokens: Sequence[int] | torch.Tensor, slots: torch.Tensor) -> int:
        """Cache the full pages of ``tokens`` whose KV is written at ``slots``.

        Args:
            tokens: committed token ids (KV written for every one of them), length L.
            slots: int64 [L], ``req_to_token[row, :L]``. Only the first L // page_size * page_size
                are used; each of those pages must be whole (slot[i*ps] % ps == 0, consecutive).
        Returns:
            How many leading tokens (a multiple of page_size) were already in the tree. The tree
            keeps its own slots for those; the caller frees its duplicate pages in that range (those
            it did not get from ``match_prefix``). Slots from that length up to the page-aligned
            length now belong to the tree.
        Raises:
            ValueError: length mismatch, wrong dtype/shape, slots not forming whole pages, or a
                negative token id; the tree is untouched when it raises.
        """
        key = self._as_list(tokens)
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype != torch.int64:
            raise ValueError("slots must be a 1-D int64 tensor")
        if slots.numel() != len(key):
            raise ValueError(f"slots has {slots.numel()} entries for {len(key)} tokens")
        ps = self.page_size
        n = len(key) // ps * ps
        if n:  # validate before touching the tree
            self._check_pages(slots[:n])
            if min(key[:n]) < 0:
                raise ValueError("token ids must be non-negative")
        node, pos = self._walk(key, n, split=True)
        if pos < n:
            new_slots = slots[pos:n].to("cpu", copy=True)
            hashes = []
            if self.enable_events:
                parent_hash = node.hashes[-1] if node is not self.root else self.seed
                h = parent_hash
                for s in range(pos, n, ps):
                    h = page_hash(h, key[s:s + ps])
                    hashes.append(h)
            leaf = TreeNode(key=key[pos:n], value=new_slots, hashes=hashes, start=pos, parent=node,
                            last_access=self._clock)
            node.children[tuple(key[pos:pos + ps])] = leaf
            self._evictable += (n - pos) // ps
            self.inserted_pages_total += (n - pos) // ps
            if self.enable_events:
                self._events.append(CacheEvent("insert", tuple(hashes), parent_hash, pos, n))
        return pos

    def insert_finished(self, tokens: Sequence[int], row_slots: torch.Tensor, own_from_page: int) -> range:
        """Steps 4-5 of the usage above for a request that ends: insert the full pages of its
        committed ``tokens`` and say which of its own pages the tree now holds.

        Args:
            tokens: committed token ids (KV written for each), length L.
            row_slots: int64 [>= L // page_size * page_size], the request's ``req_to_token`` row.
            own_from_page: first logical page the request owns (its locked prefix ends there).
        Returns:
            Logical pages ``[start, stop)`` of the request's own pages that now belong to the tree;
            the caller frees its other own pages (duplicates before ``start``, the partial tail from
            ``stop``), then unlocks its prefix node. Empty when nothing new was cached.
        Raises:
            ValueError: as :meth:`insert`.
        """
        ps = self.page_size
        full = len(tokens) // ps * ps
        n_dup = self.insert(tokens[:full], row_slots[:full].clone())
        return range(max(n_dup // ps, own_from_page), full // ps)

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock ``node`` and its ancestors (their pages become protected).

        Returns:
            Pages moved from evictable to protected by this call.
        Raises:
            RuntimeError: ``node`` was evicted (an unlocked node was held across an ``evict``);
                nothing changes.
        """
        cur = node
        while cur is not self.root:
            if cur.parent is None:
                raise RuntimeError("inc_lock_ref on an evicted node: lock it right after match_prefix")
            cur = cur.parent
        moved = 0
        while node is not self.root:
            if node.lock_ref == 0:
                pages = len(node.key) // self.page_size
                self._evictable -= pages
                self._protected += pages
                moved += pages
            node.lock_ref += 1
            node = node.parent
        return moved

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one ``inc_lock_ref(node)``.

        Returns:
            Pages moved from protected back to evictable.
        Raises:
            RuntimeError: a lock count would drop below zero (unbalanced unlock); nothing changes.
        """
        cur = node
        while cur is not self.root:
            if cur.lock_ref <= 0:
                raise RuntimeError("dec_lock_ref without a matching inc_lock_ref")
            cur = cur.parent
        moved, freed = 0, []
        while node is not self.root:
            node.lock_ref -= 1
            parent = node.parent
            if node.lock_ref == 0:
                pages = len(node.key) // self.page_size
                self._protected -= pages
                if node.detached:  # its last holder is gone
                    freed.append(self._drop_detached(node))
                else:
                    self._evictable += pages
                    moved += pages
            node = parent
        if freed:
            self._free(torch.cat(freed))
        return moved

    # ------------------------------------------------------------------ events, stats
    def drain_events(self) -> list[CacheEvent]:
        """Return and clear the recorded events (empty unless ``enable_events``)."""
        out, self._events = self._events, []
        return out

    def stats(self) -> CacheStats:
        """O(nodes) snapshot: node count, evictable/protected pages, min/max lock ref."""
        return radix_audit.stats(self)

    def check_invariants(self, *, num_pages: int | None = None, free_pages: int | None = None,
                         owned_pages: int = 0, expect_unlocked: bool = False) -> CacheStats:
        """Verify the tree (O(nodes)); raise AssertionError naming the first broken rule.

        Checks: keys page-aligned and non-empty, values int64 of whole pages, children keyed by
        their first page, positions and hash chains consistent, lock_ref >= 0 and a parent's
        lock_ref >= each child's, detached nodes locked and unreachable by a match, the
        evictable/protected counters equal a recount (detached pages are protected), no page held
        twice. With ``num_pages`` and ``free_pages``: free + evictable + protected + owned_pages ==
        num_pages. With ``expect_unlocked``: every lock count is 0 (all requests ended).
        Returns:
            ``stats()``.
        """
        return radix_audit.check_invariants(self, num_pages=num_pages, free_pages=free_pages,
                                            owned_pages=owned_pages, expect_unlocked=expect_unlocked)

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _as_list(tokens: Sequence[int] | torch.Tensor) -> list[int]:
        if isinstance(tokens, torch.Tensor):
            if tokens.dim() != 1:
                raise ValueError("tokens must be 1-D")
            return tokens.tolist()
        return list(tokens)

    def _walk(self, key: list[int], n: int, split: bool) -> tuple[TreeNode, int]:
        """Follow key[:n] (n page-aligned) down the tree; return (deepest node, matched tokens).

        Matched nodes get a fresh access stamp; a node matched only partly is split first so that
        its unmatched tail keeps its old stamp.
        """
        ps = self.page_size
        self._clock += 1
        node, pos = self.root, 0
        while pos < n:
            child = node.children.get(tuple(key[pos:pos + ps]))
            if child is None:
                break
            ck = child.key
            if len(ck) <= n - pos and ck == key[pos:pos + len(ck)]:
                m = len(ck)  # whole edge matches (the common case): one C-level compare
            else:
                m = ps
                while m < len(ck) and pos + m < n and ck[m:m + ps] == key[pos + m:pos + m + ps]:
                    m += ps
            if m < len(ck):
                child = self._split(child, m)
            child.last_access = self._clock
            node, pos = child, pos + m
            if m < len(ck):
                break
        return node, pos

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after ``m`` tokens (page-aligned); return the new upper node."""
        ps = self.page_size
        upper = TreeNode(key=child.key[:m], value=child.value[:m], hashes=child.hashes[:m // ps],
                         start=child.start, parent=child.parent, lock_ref=child.lock_ref,
                         last_access=child.last_access)
        upper.parent.children[tuple(child.key[:ps])] = upper
        child.key = child.key[m:]
        child.value = child.value[m:]
        child.hashes = child.hashes[m // ps:]
        child.start += m
        child.parent = upper
        upper.children[tuple(child.key[:ps])] = child
        return upper

    def _check_pages(self, slots: torch.Tensor) -> None:
        ps = self.page_size
        pages = slots.reshape(-1, ps)  # on the pool's device (a CUDA row of req_to_token, say)
        if not bool((pages[:, 0] % ps == 0).all()) or not bool(
                (pages == pages[:, :1] + torch.arange(ps, device=pages.device)).all()):
            raise ValueError("slots of a page-aligned prefix must be whole pages "
                             "(slot = page * page_size + offset, offset = position % page_size)")
        if bool((pages[:, 0] < 0).any()):
            raise ValueError("negative slot")
