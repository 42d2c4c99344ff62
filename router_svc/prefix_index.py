"""Page-aligned prefix index of the prompts recently sent to one worker (cache-aware routing).

A prompt is cut into full pages of ``page_size`` tokens; page ``i``'s key is a chained hash over pages
``0..i`` (so one key stands for a whole prefix, as a radix-tree path would). The index keeps the most
recently used keys (LRU, at most ``max_pages``) and answers "how many leading tokens of this prompt
did this worker see recently", in whole pages. Same page alignment as the workers' radix caches,
which match only whole pages. Design after SMG's gRPC ``TokenTree`` (block_size 16, LRU eviction);
keys are ``engine.kvcache.page_hash`` chained blake2b hashes, never Python's salted ``hash()`` (keys must
agree across processes and restarts).
"""

from __future__ import annotations

from collections import OrderedDict

from engine.kvcache.page_hash import page_hashes


def page_keys(token_ids: list[int], page_size: int) -> list[int]:
    """Chained 64-bit keys of the full pages of ``token_ids`` (``engine.kvcache.page_hash.page_hashes``:
    the same keys the workers' radix caches use). A trailing partial page gets no key."""
    return page_hashes(token_ids, page_size)


class PrefixIndex:
    """LRU set of chained page keys for one worker.

    Args:
        page_size: tokens per page (the workers' ``--page-size``).
        max_pages: capacity in pages; the least recently used keys are dropped beyond it.
    """

    def __init__(self, page_size: int, max_pages: int = 1 << 16) -> None:
        self.page_size = page_size
        self.max_pages = max_pages
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, keys: list[int]) -> int:
        """Number of leading tokens (a multiple of ``page_size``) whose pages are in the index."""
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n * self.page_size

    def insert(self, keys: list[int]) -> None:
        """Record a prompt's page keys as most recently used."""
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.max_pages:
            self._keys.popitem(last=False)
