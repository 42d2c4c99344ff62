"""Stats and invariant checks of a ``RadixCache`` (O(nodes) walks, kept out of the tree's hot code).

Both walks cover the live tree and the detached subtrees (invalidated while locked: out of the tree
for every match, their pages still protected until the last lock drops).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.kvcache.page_hash import page_hash
from engine.kvcache.radix_node import CacheStats, TreeNode

if TYPE_CHECKING:
    from engine.kvcache.radix_cache import RadixCache


def _all_nodes(cache: RadixCache) -> list[TreeNode]:
    out, stack = [], list(cache.root.children.values()) + list(cache.detached_tops)
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def stats(cache: RadixCache) -> CacheStats:
    """Node count, evictable/protected pages, min/max lock ref (detached nodes included)."""
    refs = [n.lock_ref for n in _all_nodes(cache)]
    return CacheStats(len(refs), cache.evictable_size(), cache.protected_size(), min(refs, default=0),
                      max(refs, default=0), cache.inserted_pages_total, cache.evicted_pages_total)


def check_invariants(cache: RadixCache, *, num_pages: int | None = None, free_pages: int | None = None,
                     owned_pages: int = 0, expect_unlocked: bool = False) -> CacheStats:
    """See ``RadixCache.check_invariants``."""
    ps = cache.page_size
    evictable = protected = 0
    seen: set[int] = set()
    assert not cache.root.detached and all(c.parent is cache.root for c in cache.root.children.values())
    for c in _all_nodes(cache):
        parent = c.parent
        assert all(g.parent is c for g in c.children.values()), "child.parent mismatch"
        assert len(c.key) > 0 and len(c.key) % ps == 0, "key not page-aligned"
        assert c.value.dtype == torch.int64 and c.value.numel() == len(c.key), "bad value"
        assert c.start == parent.end, "start position"
        if c in cache.detached_tops:
            assert c.detached and all(g is not c for g in parent.children.values()), "detached top"
        else:
            assert c.detached == parent.detached, "a live node under a detached one"
            assert parent.children.get(tuple(c.key[:ps])) is c, "child keyed by the wrong page"
        if cache.enable_events:
            assert len(c.hashes) == len(c.key) // ps, "hash count"
            h = parent.hashes[-1] if parent is not cache.root else cache.seed
            for i, s in enumerate(range(0, len(c.key), ps)):
                h = page_hash(h, c.key[s:s + ps])
                assert c.hashes[i] == h, "hash chain broken"
        else:
            assert not c.hashes, "hashes kept without enable_events"
        assert c.lock_ref >= 0, f"negative lock_ref {c.lock_ref}"
        assert not c.detached or c.lock_ref > 0, "unlocked detached node not freed"
        if parent is not cache.root:
            assert parent.lock_ref >= c.lock_ref, "parent less locked than child"
        if expect_unlocked:
            assert c.lock_ref == 0, f"lock_ref {c.lock_ref} after all requests ended"
        pages = c.value.view(-1, ps)
        assert bool((pages[:, 0] % ps == 0).all()), "slot run not page-aligned"
        assert bool((pages == pages[:, :1] + torch.arange(ps)).all()), "page not whole"
        ids = (pages[:, 0] // ps).tolist()
        assert seen.isdisjoint(ids) and len(set(ids)) == len(ids), "page held twice"
        seen.update(ids)
        if c.lock_ref:
            protected += len(ids)
        else:
            evictable += len(ids)
    assert evictable == cache.evictable_size(), f"evictable {cache.evictable_size()} != recount {evictable}"
    assert protected == cache.protected_size(), f"protected {cache.protected_size()} != recount {protected}"
    if num_pages is not None and free_pages is not None:
        total = free_pages + evictable + protected + owned_pages
        assert total == num_pages, (f"free {free_pages} + evictable {evictable} + protected "
                                    f"{protected} + owned {owned_pages} = {total} != pool {num_pages}")
    return stats(cache)
