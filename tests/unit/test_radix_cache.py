"""engine.kvcache.radix_cache: page alignment, multi-turn, locks, LRU eviction, events, accounting."""

import pytest
import torch

from engine.kvcache.page_hash import page_hashes
from engine.kvcache.radix_cache import RadixCache
from tests.unit.radix_flow import Flow, TestAllocator


def make(ps, num_pages=64, events=False):
    alloc = TestAllocator(num_pages, ps)
    return Flow(RadixCache(ps, alloc, enable_events=events), alloc, num_pages)


def seq(n, base=1000):
    return list(range(base, base + n))


ALIGN_CASES = [(ps, k * ps + d) for ps in (1, 4, 16) for k in (1, 2, 3) for d in (-1, 0, 1)
               if k * ps + d > 0]


@pytest.mark.parametrize("ps,length", ALIGN_CASES)
def test_page_alignment_of_shared_prefixes(ps, length):
    """Prompts of k*ps-1, k*ps, k*ps+1 tokens; a sharer gets floor(shared/ps)*ps tokens matched."""
    f = make(ps)
    a = f.start(seq(length))
    assert a.pre_len == 0
    f.finish(a)
    f.check(idle=True)
    assert f.cache.total_size() == length // ps
    for shared in range(0, length + 1):
        b_tokens = seq(length)[:shared] + [7] * (ps + 3)  # diverges right after `shared`
        slots, node = f.cache.match_prefix(b_tokens)
        want = shared // ps * ps
        assert slots.numel() == want == node.end
        assert torch.equal(slots, a.row[:want])
    # the full prompt itself matches its page-aligned part only (a partial page is never shared)
    slots, _ = f.cache.match_prefix(seq(length))
    assert slots.numel() == length // ps * ps
    f.check(idle=True)


@pytest.mark.parametrize("ps", [1, 4])
def test_multi_turn_matches_committed_tokens_only(ps):
    f = make(ps)
    prompt1 = seq(10)
    output1 = [5, 6, 7, 8, 9]
    # turn 1: the prompt and all outputs but the last sampled token have KV
    r1 = f.start(prompt1 + output1)  # slots for every token (the last one's KV is never written)
    kv_len = len(prompt1) + len(output1) - 1
    f.finish(r1, kv_len=kv_len)
    f.check(idle=True)
    turn2 = prompt1 + output1 + [42, 43, 44, 45, 46]
    r2 = f.start(turn2)
    assert r2.pre_len == kv_len // ps * ps  # 14 with ps=1 (not 15), 12 with ps=4
    assert torch.equal(r2.row[: r2.pre_len], r1.row[: r2.pre_len])
    assert f.finish(r2, kv_len=len(turn2) - 1) == r2.pre_len
    f.check(idle=True)
    assert f.alloc.num_free + f.cache.evictable_size() == f.num_pages


def test_concurrent_misses_then_duplicate_insert_frees_duplicates():
    f = make(4, num_pages=16)
    toks = seq(13)
    a, b = f.start(toks), f.start(toks)  # both miss, both compute the same prompt
    assert a.pre_len == b.pre_len == 0
    f.check()
    assert f.finish(a) == 0
    assert f.finish(b) == 12  # the tree already had 3 pages; b frees its own copies
    f.check(idle=True)
    assert f.cache.total_size() == 3 and f.alloc.num_free == 13


def test_locks_follow_the_path_and_survive_splits():
    f = make(2)
    r = f.start(seq(8))
    f.finish(r)  # one node of 4 pages
    slots, node = f.cache.match_prefix(seq(4) + [0, 0])  # splits it after 2 pages
    assert slots.numel() == 4 and f.cache.stats().node_count == 2
    assert f.cache.inc_lock_ref(node) == 2
    assert (f.cache.protected_size(), f.cache.evictable_size()) == (2, 2)
    assert f.cache.inc_lock_ref(node) == 0  # already protected
    _, deep = f.cache.match_prefix(seq(8))
    assert f.cache.inc_lock_ref(deep) == 2
    s = f.check()
    assert (s.min_lock_ref, s.max_lock_ref) == (1, 3)
    # a split inside the locked deep node keeps counts per page
    _, mid = f.cache.match_prefix(seq(6))
    assert mid.lock_ref == 1 and f.check().node_count == 3
    assert f.cache.dec_lock_ref(deep) == 2
    assert f.cache.dec_lock_ref(node) == 0
    assert f.cache.dec_lock_ref(node) == 2
    f.check(idle=True)
    with pytest.raises(RuntimeError):
        f.cache.dec_lock_ref(node)
    f.check(idle=True)  # the failed unlock changed nothing


def test_eviction_is_lru_over_unlocked_leaves():
    f = make(2, num_pages=32)
    names = {}
    for base in (100, 200, 300):
        r = f.start(seq(4, base))
        f.finish(r)
        names[base] = pages_of_row(r.row, 2)
    f.cache.match_prefix(seq(4, 100))  # touch 100: now 200 is the oldest
    alloc = f.alloc
    assert f.cache.evict(2) == 2
    assert sorted(alloc.freed_log[-1]) == sorted(names[200])
    assert f.cache.evict(1) == 1  # trims the tail page of 300's leaf, keeps its first page
    assert alloc.freed_log[-1] == [names[300][1]]
    assert f.cache.match_prefix(seq(4, 300))[0].numel() == 2
    # lock 100: eviction never touches it, and returns only what it could
    _, n100 = f.cache.match_prefix(seq(4, 100))
    f.cache.inc_lock_ref(n100)
    assert f.cache.evict(100) == 1  # only 300's remaining page was evictable
    assert f.cache.evictable_size() == 0 and f.cache.protected_size() == 2
    assert f.cache.evict(5) == 0
    assert f.cache.match_prefix(seq(4, 100))[0].numel() == 4
    f.cache.dec_lock_ref(n100)
    f.check(idle=True)
    assert f.cache.evict(10) == 2 and f.cache.total_size() == 0
    assert f.alloc.num_free == 32
    with pytest.raises(RuntimeError):  # n100 was evicted: locking it now would leak a lock
        f.cache.inc_lock_ref(n100)
    s = f.cache.stats()
    assert (s.inserted_pages_total, s.evicted_pages_total, s.node_count) == (6, 6, 0)


def test_eviction_never_takes_an_inner_node_with_children():
    f = make(2, num_pages=32)
    stem = seq(4)
    r = f.start(stem + [1, 1])
    f.finish(r)
    r = f.start(stem + [2, 2, 2, 2])
    f.finish(r)
    f.cache.match_prefix(stem)  # the stem is now the most recent node... but it has children
    assert f.cache.stats().node_count == 3
    stem_pages = sorted(pages_of_row(r.row[:4], 2))
    freed = []
    while f.cache.evictable_size() > 2:
        assert f.cache.evict(1) == 1
        freed += f.alloc.freed_log[-1]
        assert not set(freed) & set(stem_pages)
        assert f.cache.match_prefix(stem)[0].numel() == 4
    assert f.cache.evict(2) == 2 and sorted(f.alloc.freed_log[-1]) == stem_pages
    f.check(idle=True)


def test_evict_pressure_through_the_flow():
    ps, pool = 4, 8
    f = make(ps, num_pages=pool)
    for base in range(5):
        r = f.start(seq(13, 100 * base + 1))  # 4 pages each: the pool holds two
        assert r is not None, "eviction must make room"
        f.check()
        f.finish(r)
        f.check(idle=True)
    assert f.cache.total_size() + f.alloc.num_free == pool
    # two running requests lock everything: a third one cannot get pages and holds nothing
    a, b = f.start(seq(16, 7000)), f.start(seq(16, 8000))
    assert a is not None and b is not None
    assert f.start(seq(4, 9000)) is None
    f.check()
    f.abort(a)
    f.finish(b)
    f.check(idle=True)


def test_insert_rejects_bad_slots_and_changes_nothing():
    f = make(4)
    r = f.start(seq(8))
    f.finish(r)
    before = f.check(idle=True)
    bad = [
        (seq(8, 50), torch.arange(8, dtype=torch.int32) + 16),  # dtype
        (seq(8, 50), torch.arange(7, dtype=torch.int64) + 16),  # length
        (seq(8, 50), torch.arange(8, dtype=torch.int64) + 18),  # not page-aligned
        (seq(8, 50), torch.tensor([16, 17, 18, 19, 24, 26, 25, 27])),  # page not whole
        # sharing the cached first page: must fail before the walk splits or touches anything
        (seq(4) + [-1] * 4, torch.arange(8, dtype=torch.int64) + 16),  # negative token id
        (seq(4) + [5] * 4, torch.tensor([16, 17, 18, 19, 24, 26, 25, 27])),
    ]
    for toks, slots in bad:
        with pytest.raises(ValueError):
            f.cache.insert(toks, slots)
    assert f.check(idle=True) == before
    assert f.cache._clock == 2  # no walk happened for the rejected inserts
    with pytest.raises(ValueError):
        RadixCache(0, f.alloc)
    with pytest.raises(ValueError):
        f.cache.match_prefix(torch.zeros(2, 2, dtype=torch.int64))


def test_events_report_inserted_and_evicted_page_ranges():
    f = make(4, events=True)
    toks = seq(10)
    f.finish(f.start(toks))
    branch = toks[:4] + [9] * 8
    f.finish(f.start(branch))
    ev = f.cache.drain_events()
    assert f.cache.drain_events() == []
    ha, hb = page_hashes(toks, 4), page_hashes(branch, 4)
    assert [(e.kind, e.page_hashes, e.parent_hash, e.token_start, e.token_end) for e in ev] == [
        ("insert", tuple(ha), 0, 0, 8),
        ("insert", tuple(hb[1:]), ha[0], 4, 12),
    ]
    f.cache.match_prefix(toks)  # branch becomes the LRU leaf
    assert f.cache.evict(3) == 3
    ev = f.cache.drain_events()
    assert [(e.kind, e.page_hashes, e.token_start, e.token_end) for e in ev] == [
        ("evict", tuple(hb[1:]), 4, 12),
        ("evict", tuple(ha[1:]), 4, 8),
    ]
    f.check(idle=True)
    off = RadixCache(4, f.alloc)
    off.insert(seq(4, 500), torch.arange(4, dtype=torch.int64) + 60)
    assert off.drain_events() == []


def test_tensor_tokens_and_empty_inputs():
    f = make(4)
    slots, node = f.cache.match_prefix(torch.tensor([], dtype=torch.int64))
    assert slots.numel() == 0 and node is f.cache.root
    assert f.cache.insert([1, 2, 3], torch.arange(3, dtype=torch.int64)) == 0  # < 1 page: no-op
    assert f.cache.total_size() == 0
    assert f.cache.inc_lock_ref(node) == 0 and f.cache.dec_lock_ref(node) == 0  # root: no-op
    assert f.cache.evict(3) == 0 and f.cache.evict(0) == 0
    f.cache.insert(torch.tensor(seq(8)), torch.arange(8, dtype=torch.int64) + 8)
    assert torch.equal(f.cache.match_prefix(torch.tensor(seq(8)))[0], torch.arange(8) + 8)


def pages_of_row(row, ps):
    return (row[row % ps == 0] // ps).tolist()


def test_insert_finished_returns_the_own_pages_the_tree_took():
    """A second request sharing 2 of its 3 full pages: the tree keeps only its third page; the
    duplicate and the partial tail stay the caller's to free."""
    from engine.kvcache.page_allocator import PageAllocator
    from engine.kvcache.radix_cache import RadixCache

    ps = 4
    alloc = PageAllocator(num_pages=16, page_size=ps)
    cache = RadixCache(ps, alloc)
    first = list(range(100, 110))                      # 2 full pages + 2 tokens
    row = alloc.alloc_slots(0, len(first), None)
    kept = cache.insert_finished(first, row, own_from_page=0)
    assert kept == range(0, 2)
    alloc.free_slots(row[kept.stop * ps:])             # the partial tail page
    second = first[:8] + [7, 7, 7, 7, 9]               # shares 2 pages, 1 new full page, 1 partial
    prefix, node = cache.match_prefix(second)
    cache.inc_lock_ref(node)
    assert prefix.numel() == 4 * 2
    own = alloc.alloc_slots(8, len(second), None)
    row2 = torch.cat([prefix, own])
    kept = cache.insert_finished(second, row2, own_from_page=2)
    assert kept == range(2, 3)
    alloc.free_slots(row2[kept.stop * ps:])
    cache.dec_lock_ref(node)
    assert alloc.num_free + cache.evictable_size() + cache.protected_size() == 16
    assert cache.protected_size() == 0 and cache.evictable_size() == 3
