"""RadixCache.invalidate: a page whose KV cannot be trusted and everything below it leave the tree;
unlocked pages are freed at once, locked ones are detached (no match finds them) and freed when
the last lock drops, with free + evictable + protected + owned == pool all along."""

import torch

from engine.kvcache.page_allocator import PageAllocator
from engine.kvcache.radix_cache import RadixCache

PS = 2
A = [1, 2, 3, 4, 5, 6]          # three pages
B = [1, 2, 9, 9]                # shares A's first page


def setup():
    alloc = PageAllocator(16, PS)
    freed = []

    def free(ids):
        freed.extend(ids.tolist())
        alloc.free(ids)

    cache = RadixCache(PS, free, enable_events=True)
    for tokens in (A, B):
        _, node = cache.match_prefix(tokens)
        pre = node.end
        slots = alloc.alloc_slots(pre, len(tokens), None)
        row = torch.cat([cache.match_prefix(tokens)[0], slots])
        cache.insert(tokens, row)
    return alloc, cache, freed


def pages_of(cache, tokens):
    return (cache.match_prefix(tokens)[0][::PS] // PS).tolist()


def check(alloc, cache, owned=0):
    cache.check_invariants(num_pages=16, free_pages=alloc.num_free, owned_pages=owned)


def test_unlocked_pages_are_freed_at_once():
    alloc, cache, freed = setup()
    a_pages = pages_of(cache, A)
    cache.drain_events()
    assert cache.invalidate(A, 1) == 2
    assert sorted(freed) == sorted(a_pages[1:])
    assert pages_of(cache, A) == a_pages[:1] and len(pages_of(cache, B)) == 2   # the rest stays
    ev = cache.drain_events()
    assert [e.kind for e in ev] == ["evict"] and (ev[0].token_start, ev[0].token_end) == (2, 6)
    assert cache.invalidate(A, 1) == 0 and cache.invalidate([7, 7, 7, 7], 1) == 0   # not cached
    assert cache.invalidate(A[:3], 1) == 0                                          # no such page
    check(alloc, cache)
    assert cache.total_size() == 2 and cache.stats().evicted_pages_total == 2


def test_locked_pages_are_detached_until_the_last_lock_drops():
    alloc, cache, freed = setup()
    slots, held = cache.match_prefix(A)
    a_pages = (slots[::PS] // PS).tolist()
    cache.inc_lock_ref(held)
    cache.inc_lock_ref(held)                     # two requests hold all of A
    assert cache.invalidate(A, 1) == 2 and freed == []
    assert cache.detached(held) and not cache.detached(cache.match_prefix(A)[1])
    assert pages_of(cache, A) == a_pages[:1]     # no new match finds the detached pages
    assert cache.protected_size() == 3           # still held: page 0 and the two detached pages
    check(alloc, cache)
    # the prompt is cached again from fresh pages while the old ones are still held
    row = torch.cat([cache.match_prefix(A)[0], alloc.alloc_slots(2, 6, None)])
    assert cache.insert(A, row) == 2
    check(alloc, cache)
    cache.dec_lock_ref(held)
    assert freed == []
    check(alloc, cache)
    cache.dec_lock_ref(held)                     # last holder gone: the detached pages are freed
    assert sorted(freed) == sorted(a_pages[1:])
    assert not cache.detached_tops and cache.protected_size() == 0
    cache.check_invariants(num_pages=16, free_pages=alloc.num_free, expect_unlocked=True)
    assert cache.stats().inserted_pages_total - cache.stats().evicted_pages_total == cache.total_size()


def test_invalidating_above_a_detached_node_frees_both_when_unlocked():
    alloc, cache, freed = setup()
    _, deep = cache.match_prefix(A)
    cache.inc_lock_ref(deep)
    assert cache.invalidate(A, 2) == 1           # detached, held by `deep`
    assert cache.invalidate(A, 0) == 3           # page 0 (locked: detached), B's page (freed), A's page 1
    assert pages_of(cache, A) == [] and pages_of(cache, B) == []
    check(alloc, cache)
    cache.dec_lock_ref(deep)
    assert cache.total_size() == 0 and alloc.num_free == 16
    cache.check_invariants(num_pages=16, free_pages=alloc.num_free, expect_unlocked=True)
