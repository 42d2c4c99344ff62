"""Page and slot arithmetic, in one place.

A slot is ``page * page_size + offset``. Token ``pos`` of a request always lives at offset
``pos % page_size`` of its page, so a request of ``L`` tokens holds ``ceil(L / page_size)`` pages and
only its last page may be partly filled; the slots of a page-aligned run of tokens are whole pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` tokens: ``ceil(tokens / page_size)``."""
    return -(-tokens // page_size)


def page_slots(pages: Sequence[int], page_size: int, n: int | None = None) -> torch.Tensor:
    """Slots of ``pages`` in order, the first ``n`` of them (all when None): int64 [n], CPU."""
    if not len(pages):
        return torch.empty(0, dtype=torch.int64)
    pg = torch.as_tensor(list(pages), dtype=torch.int64)
    slots = (pg[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)
    return slots if n is None else slots[:n]


def pages_of_slots(slots: torch.Tensor, page_size: int) -> list[int]:
    """Page ids of a run of slots that starts on a page boundary (int64 [N]): one per page, in order."""
    if slots.numel() == 0:
        return []
    return (slots.to("cpu", torch.int64)[::page_size] // page_size).tolist()
