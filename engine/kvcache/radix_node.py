"""The radix cache's records: tree nodes, cache events and stats snapshots
(``engine.kvcache.radix_cache`` is the tree itself)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch


class PageFreer(Protocol):
    def free(self, page_ids: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class CacheEvent:
    """Pages that entered or left the tree.

    kind: ``"insert"`` or ``"evict"``.
    page_hashes: chained page hashes (``engine.kvcache.page_hash``), one per page, in sequence order.
    parent_hash: hash of the page before the first one (``seed`` at position 0).
    token_start, token_end: the token positions [start, end) those pages cover (multiples of
        page_size) in any sequence with this prefix.
    """

    kind: Literal["insert", "evict"]
    page_hashes: tuple[int, ...]
    parent_hash: int
    token_start: int
    token_end: int


@dataclass(frozen=True)
class CacheStats:
    """Snapshot for servers (``/metrics``, ``GetLoad``) and tests; sizes in pages.

    min_lock_ref is over non-root nodes (0 for an empty tree); node_count excludes the root;
    inserted_pages_total / evicted_pages_total count since construction (monotonic, for counters;
    invalidated pages count as evicted once freed).
    """

    node_count: int
    evictable_pages: int
    protected_pages: int
    min_lock_ref: int
    max_lock_ref: int
    inserted_pages_total: int = 0
    evicted_pages_total: int = 0


@dataclass(eq=False)
class TreeNode:
    """One edge of the tree: ``key`` tokens (a multiple of page_size) with their ``value`` slots.

    ``detached``: the node was invalidated while locked. It is out of its parent's children (no
    match finds it) but keeps ``parent``, so the requests holding it unlock the path they locked;
    its pages are freed when its lock count drops to zero.
    """

    key: list[int]
    value: torch.Tensor  # int64 [len(key)], slots
    hashes: list[int]  # chained page hash of each page of key (kept only with enable_events)
    start: int  # token position of key[0] in the sequence
    parent: TreeNode | None = None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    detached: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.key)
