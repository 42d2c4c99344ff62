"""Test helper: one request's life against a RadixCache + page allocator, in the exact order the
RadixCache docstring prescribes (match+lock -> alloc delta -> extend -> insert committed -> free
duplicates -> unlock). Owned pages are tracked so tests can check the pool accounting invariant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kvcache.radix_cache import RadixCache, TreeNode


class TestAllocator:
    """Minimal page free list (free(page_ids) raises on a double free), used where a test wants to
    see exactly which pages come back. The engine's PageAllocator is used by the flow tests."""

    __test__ = False

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))
        self.freed_log: list[list[int]] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, pages) -> None:
        pages = [int(p) for p in (pages.tolist() if isinstance(pages, torch.Tensor) else pages)]
        assert len(set(pages)) == len(pages) and not set(pages) & set(self._free), "double free"
        assert all(0 <= p < self.num_pages for p in pages)
        self.freed_log.append(pages)
        self._free.extend(pages)


def pages_of(slots: torch.Tensor, page_size: int) -> list[int]:
    """Page ids of the pages that start inside ``slots`` (a page-aligned run of whole pages)."""
    return (slots[slots % page_size == 0] // page_size).tolist()


@dataclass
class Req:
    tokens: list[int]
    row: torch.Tensor  # int64 [allocated_len], req_to_token row
    pre_len: int
    node: TreeNode
    owned: set[int] = field(default_factory=set)  # pages this request must free itself


class Flow:
    """Drives requests through ``cache`` with ``alloc`` (``.alloc(n)``, ``.free(ids)``, ``.num_free``)."""

    def __init__(self, cache: RadixCache, alloc, num_pages: int):
        self.cache, self.alloc, self.num_pages = cache, alloc, num_pages
        self.ps = cache.page_size
        self.running: list[Req] = []

    def start(self, tokens: list[int], match_len: int | None = None) -> Req | None:
        """match+lock, then alloc the delta for all of ``tokens``; None (nothing held) if the pool is short."""
        ps = self.ps
        key = tokens if match_len is None else tokens[:match_len]
        prefix, node = self.cache.match_prefix(key)
        pre_len = prefix.numel()
        self.cache.inc_lock_ref(node)
        need = -(-len(tokens) // ps) - pre_len // ps
        if self.alloc.num_free < need:
            self.cache.evict(need - self.alloc.num_free)
        pages = self.alloc.alloc(need)
        if pages is None:
            self.cache.dec_lock_ref(node)
            return None
        body = (torch.tensor(pages, dtype=torch.int64)[:, None] * ps + torch.arange(ps)).reshape(-1)
        row = torch.cat([prefix, body[: len(tokens) - pre_len]])
        req = Req(list(tokens), row, pre_len, node, set(pages))
        self.running.append(req)
        return req

    def finish(self, req: Req, kv_len: int | None = None) -> int:
        """insert the first ``kv_len`` tokens (those with KV written), free duplicates and the tail, unlock.

        Returns insert()'s count of tokens already cached.
        """
        ps = self.ps
        kv_len = len(req.tokens) if kv_len is None else kv_len
        assert req.pre_len <= kv_len <= len(req.tokens)
        n_dup = self.cache.insert(req.tokens[:kv_len], req.row[:kv_len])
        dup = pages_of(req.row[req.pre_len:max(n_dup, req.pre_len)], ps)
        aligned = kv_len // ps * ps
        tail = pages_of(req.row[aligned:], ps)
        for p in dup + tail:
            req.owned.remove(p)
        # what is left was handed to the tree
        assert req.owned == set(pages_of(req.row[max(n_dup, req.pre_len):aligned], ps))
        if dup + tail:
            self.alloc.free(dup + tail)
        req.owned.clear()
        self.cache.dec_lock_ref(req.node)
        self.running.remove(req)
        return n_dup

    def abort(self, req: Req) -> None:
        """Drop the request without caching anything."""
        if req.owned:
            self.alloc.free(sorted(req.owned))
        req.owned.clear()
        self.cache.dec_lock_ref(req.node)
        self.running.remove(req)

    def owned_pages(self) -> int:
        return sum(len(r.owned) for r in self.running)

    def check(self, idle: bool = False):
        return self.cache.check_invariants(num_pages=self.num_pages, free_pages=self.alloc.num_free,
                                           owned_pages=self.owned_pages(), expect_unlocked=idle)
