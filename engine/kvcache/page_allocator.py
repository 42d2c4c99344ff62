"""Page allocator: a free list of KV page ids.

Slot = page * page_size + offset (docs/architecture.md, KV memory). The allocator hands out whole pages; a request's
tokens fill its pages in order, so a request at length ``L`` owns ``ceil(L / page_size)`` pages and
only its last page may be partly filled. Invariant: ``num_free + num_used == num_pages``.
"""

from __future__ import annotations

import torch

from engine.kvcache.paging import page_slots


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, device: str | torch.device = "cpu"):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives low ids first
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` pages; returns their ids, or None (nothing taken) when fewer are free."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self._is_free[p] = 0
        return out

    def free(self, pages) -> None:
        """Return pages. Raises ValueError on a double free or an out-of-range id (nothing freed)."""
        pages = [int(p) for p in (pages.tolist() if isinstance(pages, torch.Tensor) else pages)]
        seen = set()
        for p in pages:
            if not 0 <= p < self.num_pages or self._is_free[p] or p in seen:
                raise ValueError(f"free of page {p}: out of range or already free")
            seen.add(p)
        # Push in descending order so the next alloc() pops them ascending: pages freed together
        # come back as one contiguous run, which keeps KV transfers to few large puts.
        for p in sorted(pages, reverse=True):
            self._is_free[p] = 1
            self._free.append(p)

    def free_slots(self, slots: torch.Tensor) -> None:
        """Free the pages that hold ``slots`` (int64 [N]); each page must appear via its first slot.

        Slots that are not page starts are ignored, so passing a request's whole row is fine.
        """
        s = slots.to("cpu", torch.int64)
        self.free(torch.unique(s[s % self.page_size == 0] // self.page_size))

    # --- slot helpers ------------------------------------------------------------------------
    def pages_needed(self, cur_len: int, new_len: int) -> int:
        """Pages a request grows by when going from ``cur_len`` to ``new_len`` tokens."""
        ps = self.page_size
        return -(-new_len // ps) - (-(-cur_len // ps))

    def alloc_slots(self, cur_len: int, new_len: int, last_slot: int | None) -> torch.Tensor | None:
        """Slots for tokens ``[cur_len, new_len)`` of a request whose token ``cur_len-1`` is at ``last_slot``.

        Fills the rest of the current last page first, then fresh pages. Returns int64 [new_len -
        cur_len] on ``self.device``, or None (nothing taken) when the pool is short.
        """
        ps = self.page_size
        n = new_len - cur_len
        if n <= 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        pages = self.alloc(self.pages_needed(cur_len, new_len))
        if pages is None:
            return None
        head = []
        if cur_len % ps:
            assert last_slot is not None, "a partly filled page needs last_slot"
            head = list(range(last_slot + 1, min(last_slot + 1 + n, (last_slot // ps + 1) * ps)))
        body = page_slots(pages, ps, n - len(head))
        return torch.cat([torch.tensor(head, dtype=torch.int64), body]).to(self.device)
