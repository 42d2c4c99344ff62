"""Property test: random request lives (match+lock / alloc / insert / re-lock / abort / evict /
invalidate) on
RadixCache + the engine's PageAllocator, checked step by step against a flat reference model:
one dict entry per cached page keyed by the whole token prefix up to that page's end, holding
(page id, lock count, last-access tick). After every step the tree must equal the reference
entry by entry, and free + evictable + protected + owned == pool must hold. Invalidated entries
still locked wait in ``RefCache.detached`` until their last lock drops; requests hold the entry
objects they locked, so a detached entry and a new one of the same prefix never mix.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.kvcache.page_allocator import PageAllocator
from engine.kvcache.radix_cache import RadixCache

BASE = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]


class RefCache:
    """Same semantics, no tree: pages[prefix tuple] = [page_id, lock, access]."""

    def __init__(self, ps: int):
        self.ps, self.pages, self.tick = ps, {}, 0
        self.detached: list[list] = []  # entries invalidated while locked

    def _walk(self, tokens):
        self.tick += 1
        n, ln = len(tokens) // self.ps * self.ps, 0
        while ln < n and tuple(tokens[:ln + self.ps]) in self.pages:
            ln += self.ps
            self.pages[tuple(tokens[:ln])][2] = self.tick
        return ln

    def match(self, tokens) -> list[int]:
        ln = self._walk(tokens)
        out = []
        for k in range(self.ps, ln + 1, self.ps):
            p = self.pages[tuple(tokens[:k])][0]
            out += range(p * self.ps, (p + 1) * self.ps)
        return out

    def insert(self, tokens, slots: list[int]) -> int:
        ln = self._walk(tokens)
        for k in range(ln + self.ps, len(tokens) // self.ps * self.ps + 1, self.ps):
            self.pages[tuple(tokens[:k])] = [slots[k - self.ps] // self.ps, 0, self.tick]
        return ln

    def entries(self, prefix) -> list[list]:
        return [self.pages[tuple(prefix[:k])] for k in range(self.ps, len(prefix) + 1, self.ps)]

    def lock(self, entries, delta: int) -> list[int]:
        """Add ``delta`` to each entry's lock; returns the pages of detached entries now unlocked."""
        freed = []
        for e in entries:
            e[1] += delta
            assert e[1] >= 0
            if e[1] == 0 and any(d is e for d in self.detached):
                self.detached = [d for d in self.detached if d is not e]
                freed.append(e[0])
        return freed

    def is_detached(self, entries) -> bool:
        return any(d is e for e in entries for d in self.detached)

    def invalidate(self, tokens, page: int) -> tuple[int, list[int]]:
        """(pages that left the tree, pages freed now) for dropping ``page`` and what follows."""
        n = (page + 1) * self.ps
        if len(tokens) < n:
            return 0, []
        self._walk(tokens[:page * self.ps])
        cut = tuple(tokens[:n])
        gone = [k for k in self.pages if k[:n] == cut]
        freed = []
        for k in gone:
            e = self.pages.pop(k)
            if e[1]:
                self.detached.append(e)
            else:
                freed.append(e[0])
        return len(gone), freed

    def evict(self, n: int) -> list[int]:
        freed = []
        while len(freed) < n:
            parents = {k[:-self.ps] for k in self.pages}
            leaves = [(e[2], k) for k, e in self.pages.items() if e[1] == 0 and k not in parents]
            if not leaves:
                break
            leaves.sort()
            assert len(leaves) == 1 or leaves[0][0] != leaves[1][0], "LRU tie between leaves"
            freed.append(self.pages.pop(leaves[0][1])[0])
        return freed


def tree_pages(cache: RadixCache) -> dict:
    out, stack = {}, [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            for i in range(0, len(child.key), cache.page_size):
                k = prefix + tuple(child.key[:i + cache.page_size])
                out[k] = [int(child.value[i]) // cache.page_size, child.lock_ref, child.last_access]
            stack.append((child, prefix + tuple(child.key)))
    return out


class Req:
    def __init__(self, tokens, row, pre_len, node, owned, entries):
        self.tokens, self.row, self.pre_len, self.node, self.owned = tokens, row, pre_len, node, owned
        self.entries = entries  # the reference entries it locked


class RadixMachine(RuleBasedStateMachine):
    @initialize(ps=st.sampled_from([1, 2, 4]), num_pages=st.integers(4, 14), events=st.booleans())
    def setup(self, ps, num_pages, events):
        self.ps, self.num_pages = ps, num_pages
        self.alloc = PageAllocator(num_pages, ps)
        self.freed: list[int] = []
        self.evicted = 0

        def free(ids):
            self.freed += ids.tolist()
            self.alloc.free(ids)

        self.cache = RadixCache(ps, free, enable_events=events)  # events: hash chains checked too
        self.ref = RefCache(ps)
        self.reqs: list[Req] = []

    # -- helpers
    def _pages(self, slots):
        return (slots[slots % self.ps == 0] // self.ps).tolist()

    def _match(self, key):
        slots, node = self.cache.match_prefix(key)
        assert slots.tolist() == self.ref.match(key)
        assert node.end == slots.numel()
        return slots, node

    def _evict(self, n):
        self.freed = []
        got = self.cache.evict(n)
        want = self.ref.evict(n)
        assert got == len(want) and sorted(self.freed) == sorted(want)
        self.evicted += got

    def _unlock(self, req):
        self.freed = []
        self.cache.dec_lock_ref(req.node)
        dropped = self.ref.lock(req.entries, -1)
        assert sorted(self.freed) == sorted(dropped)
        self.evicted += len(dropped)

    def _detached(self, req) -> bool:
        assert self.cache.detached(req.node) == self.ref.is_detached(req.entries)
        return self.cache.detached(req.node)

    def _insert_committed(self, req, kv_len):
        """insert + free duplicates [pre_len, n_dup) and drop them from req.owned; return aligned len."""
        toks = req.tokens[:kv_len]
        n_dup = self.cache.insert(toks, req.row[:kv_len].clone())
        assert n_dup == self.ref.insert(toks, req.row[:kv_len].tolist())
        assert n_dup >= req.pre_len
        dup = self._pages(req.row[req.pre_len:n_dup])
        if dup:
            self.alloc.free(dup)
        aligned = kv_len // self.ps * self.ps
        req.owned -= set(dup) | set(self._pages(req.row[req.pre_len:aligned]))
        return aligned

    # -- rules
    @rule(cut=st.integers(0, len(BASE)), tail=st.lists(st.integers(0, 2), max_size=6),
          whole=st.booleans())
    def start(self, cut, tail, whole):
        tokens = BASE[:cut] + tail
        if not tokens:
            return
        key = tokens if whole else tokens[:-1]
        slots, node = self._match(key)
        pre_len = slots.numel()
        self.cache.inc_lock_ref(node)
        entries = self.ref.entries(key[:pre_len])
        self.ref.lock(entries, +1)
        need = -(-len(tokens) // self.ps) - pre_len // self.ps
        if self.alloc.num_free < need:
            self._evict(need - self.alloc.num_free)
        delta = self.alloc.alloc_slots(pre_len, len(tokens), None)
        if delta is None:
            self.cache.dec_lock_ref(node)
            self.ref.lock(entries, -1)
            return
        row = torch.cat([slots, delta])
        self.reqs.append(Req(tokens, row, pre_len, node, set(self._pages(delta)), entries))

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99), frac=st.floats(0, 1))
    def finish(self, i, frac):
        req = self.reqs.pop(i % len(self.reqs))
        kv_len = req.pre_len + int(frac * (len(req.tokens) - req.pre_len))
        if not self._detached(req):  # an invalidated prefix: nothing of its row is cached
            self._insert_committed(req, kv_len)
        if req.owned:  # the partial tail page(s)
            self.alloc.free(sorted(req.owned))
        self._unlock(req)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99), frac=st.floats(0, 1))
    def cache_running(self, i, frac):
        """Chunked-prefill style: insert what is committed, re-match, move the lock, keep running."""
        req = self.reqs[i % len(self.reqs)]
        if self._detached(req):
            return
        kv_len = req.pre_len + int(frac * (len(req.tokens) - req.pre_len))
        aligned = self._insert_committed(req, kv_len)
        slots, node = self._match(req.tokens[:kv_len])
        assert slots.numel() == aligned
        self.cache.inc_lock_ref(node)
        entries = self.ref.entries(req.tokens[:aligned])
        self.ref.lock(entries, +1)
        self._unlock(req)
        req.row[:aligned] = slots
        req.node, req.pre_len, req.entries = node, aligned, entries
        assert req.owned == set(self._pages(req.row[aligned:]))

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99))
    def abort(self, i):
        req = self.reqs.pop(i % len(self.reqs))
        if req.owned:
            self.alloc.free(sorted(req.owned))
        self._unlock(req)

    @rule(cut=st.integers(0, len(BASE)), tail=st.lists(st.integers(0, 2), max_size=4),
          page=st.integers(0, 8), of_req=st.integers(-1, 99))
    def invalidate(self, cut, tail, page, of_req):
        """A page's KV is bad: it and what follows leave the tree (locked ones when unlocked)."""
        tokens = self.reqs[of_req % len(self.reqs)].tokens if of_req >= 0 and self.reqs else BASE[:cut] + tail
        self.freed = []
        got = self.cache.invalidate(tokens, page)
        want, freed = self.ref.invalidate(tokens, page)
        assert got == want and sorted(self.freed) == sorted(freed)
        self.evicted += len(freed)

    @rule(n=st.integers(0, 20))
    def evict(self, n):
        self._evict(n)

    @rule(cut=st.integers(0, len(BASE)), tail=st.lists(st.integers(0, 2), max_size=4))
    def match_only(self, cut, tail):
        self._match(BASE[:cut] + tail)

    @invariant()
    def accounting(self):
        if not hasattr(self, "cache"):
            return
        owned = sum(len(r.owned) for r in self.reqs)
        stats = self.cache.check_invariants(num_pages=self.num_pages, free_pages=self.alloc.num_free,
                                            owned_pages=owned, expect_unlocked=not self.reqs)
        assert stats.min_lock_ref >= 0
        assert stats.evicted_pages_total == self.evicted
        assert stats.inserted_pages_total - stats.evicted_pages_total == self.cache.total_size()
        assert tree_pages(self.cache) == self.ref.pages
        assert self.cache.evictable_size() == sum(e[1] == 0 for e in self.ref.pages.values())
        assert self.cache.protected_size() == (sum(e[1] > 0 for e in self.ref.pages.values())
                                               + len(self.ref.detached))

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        while self.reqs:
            self.finish(0, 1.0)
        self.cache.check_invariants(num_pages=self.num_pages, free_pages=self.alloc.num_free,
                                    expect_unlocked=True)
        assert not self.ref.detached and not self.cache.detached_tops
        self._evict(self.num_pages + 1)
        assert self.alloc.num_free == self.num_pages and self.cache.total_size() == 0


RadixMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestRadixCacheProperty = RadixMachine.TestCase
