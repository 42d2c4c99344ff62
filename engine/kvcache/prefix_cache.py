"""The prefix-cache seam: what a scheduler needs from a prefix cache, and a null one.

``engine.kvcache.radix_cache.RadixCache`` is the real implementation. ``NullPrefixCache`` stands in
when the cache is disabled (``--disable-radix-cache``): it never matches, never holds a page and
never evicts, so callers have no ``cache is None`` branches. The lifecycle built on this seam is
``engine.kvcache.cache_manager.CacheManager``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from engine.kvcache.radix_node import CacheStats


@runtime_checkable
class PrefixCache(Protocol):
    """Page-aligned prefix cache over token ids. Sizes in pages; slots are int64 tensors.

    ``enabled`` is False only for the null cache (callers skip work whose result would be dropped).
    Node handles are opaque: pass what ``match_prefix`` returned to ``inc_lock_ref``/``dec_lock_ref``.
    """

    enabled: bool

    def match_prefix(self, tokens: Sequence[int]) -> tuple[torch.Tensor, object]: ...
    def insert(self, tokens: Sequence[int], slots: torch.Tensor) -> int: ...
    def insert_finished(self, tokens: Sequence[int], row_slots: torch.Tensor, own_from_page: int) -> range: ...
    def inc_lock_ref(self, node: object) -> int: ...
    def dec_lock_ref(self, node: object) -> int: ...
    def evict(self, num_pages: int) -> int: ...
    def invalidate(self, tokens: Sequence[int], page: int) -> int: ...
    def detached(self, node: object) -> bool: ...
    def evictable_size(self) -> int: ...
    def protected_size(self) -> int: ...
    def stats(self) -> CacheStats: ...


class NullPrefixCache:
    """The prefix cache that caches nothing: every match is empty and every insert is dropped."""

    enabled = False

    def match_prefix(self, tokens: Sequence[int]) -> tuple[torch.Tensor, object]:
        return torch.empty(0, dtype=torch.int64), None

    def insert(self, tokens: Sequence[int], slots: torch.Tensor) -> int:
        return 0

    def insert_finished(self, tokens: Sequence[int], row_slots: torch.Tensor, own_from_page: int) -> range:
        return range(0)

    def inc_lock_ref(self, node: object) -> int:
        return 0

    def dec_lock_ref(self, node: object) -> int:
        return 0

    def evict(self, num_pages: int) -> int:
        return 0

    def invalidate(self, tokens: Sequence[int], page: int) -> int:
        return 0

    def detached(self, node: object) -> bool:
        return False

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def stats(self) -> CacheStats:
        return CacheStats(node_count=0, evictable_pages=0, protected_pages=0, min_lock_ref=0, max_lock_ref=0)
