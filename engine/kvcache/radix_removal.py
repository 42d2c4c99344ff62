"""Pages leaving a ``RadixCache``: LRU eviction of unlocked leaves and invalidation of untrusted
pages (a mixin of the tree: it works on ``RadixCache``'s nodes and counters)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from engine.kvcache.radix_node import CacheEvent, TreeNode


class RadixRemoval:
    """``evict`` and ``invalidate`` of ``engine.kvcache.radix_cache.RadixCache``."""


    # ------------------------------------------------------------------ invalidate
    def invalidate(self, tokens: Sequence[int] | torch.Tensor, page: int) -> int:
        """Take logical page ``page`` of the cached prefix ``tokens`` and everything below it out of
        the tree (its KV cannot be trusted).

        Unlocked nodes are freed now (``free_pages``); locked ones are detached: no match finds them,
        their pages stay protected and are freed when their last lock drops.
        Returns:
            Pages that left the tree (0 when ``tokens`` does not reach that page in the tree).
        """
        key, ps = self._as_list(tokens), self.page_size
        if page < 0 or len(key) < (page + 1) * ps:
            return 0
        node, pos = self._walk(key, page * ps, split=True)
        top = node.children.get(tuple(key[page * ps:(page + 1) * ps])) if pos == page * ps else None
        if top is None:
            return 0
        del node.children[tuple(top.key[:ps])]
        removed, freed, stack = 0, [], [top]
        while stack:
            n = stack.pop()
            pages = len(n.key) // ps
            removed += pages
            stack.extend(n.children.values())
            self._record_evict(n, 0)
            if n.lock_ref:
                n.detached = True
                continue
            self._evictable -= pages  # unlocked: so is everything below it
            self.evicted_pages_total += pages
            freed.append(n.value[::ps] // ps)
            if n is not top:
                del n.parent.children[tuple(n.key[:ps])]
            n.parent = None
        if top.detached:
            self.detached_tops.append(top)
        if freed:
            self._free(torch.cat(freed))
        return removed

    @staticmethod
    def detached(node: object) -> bool:
        """Whether ``node`` (a lock handle) was invalidated while locked."""
        return bool(getattr(node, "detached", False))

    def _drop_detached(self, node: TreeNode) -> torch.Tensor:
        """Unlink a detached node whose last lock dropped; returns its page ids to free."""
        ps = self.page_size
        self.evicted_pages_total += len(node.key) // ps
        if node in self.detached_tops:  # (identity) also one cut below an older detached node
            self.detached_tops.remove(node)
        else:
            del node.parent.children[tuple(node.key[:ps])]
        node.parent = None
        return node.value[::ps] // ps

    # ------------------------------------------------------------------ evict
    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages from least-recently-used unlocked leaves.

        Pages leave from the tail of a leaf (a leaf may be trimmed, keeping its prefix cached); a
        node whose subtree is gone becomes a leaf and is considered in its turn. Locked nodes and
        nodes with children are never touched. Freed page ids go to ``free_pages`` in one call.

        Returns:
            Pages freed: min(num_pages, what could be freed).
        """
        if num_pages <= 0:
            return 0
        ps = self.page_size
        heap = [(n.last_access, i, n) for i, n in enumerate(self._leaves()) if n.lock_ref == 0]
        heapq.heapify(heap)
        tiebreak = len(heap)
        freed: list[torch.Tensor] = []
        left = num_pages
        while left > 0 and heap:
            _, _, leaf = heapq.heappop(heap)
            pages = len(leaf.key) // ps
            take = min(pages, left)
            keep = pages - take
            gone = leaf.value[keep * ps:]
            freed.append(gone[::ps] // ps)
            self._record_evict(leaf, keep)
            self._evictable -= take
            left -= take
            if keep:
                leaf.key = leaf.key[:keep * ps]
                leaf.value = leaf.value[:keep * ps]
                leaf.hashes = leaf.hashes[:keep]
                continue
            parent = leaf.parent
            del parent.children[tuple(leaf.key[:ps])]
            leaf.parent = None
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, tiebreak, parent))
                tiebreak += 1
        self.evicted_pages_total += num_pages - left
        if freed:
            self._free(torch.cat(freed))
        return num_pages - left

    def _record_evict(self, node: TreeNode, keep: int) -> None:
        """Record that ``node``'s pages from its ``keep``-th on left the tree (with events)."""
        if self.enable_events:
            parent_hash = node.hashes[keep - 1] if keep else (
                node.parent.hashes[-1] if node.parent is not self.root else self.seed)
            self._events.append(CacheEvent("evict", tuple(node.hashes[keep:]), parent_hash,
                                           node.start + keep * self.page_size, node.end))

    def _leaves(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                out.append(n)
        return out
