"""ReqToTokenPool: per-request rows mapping token position -> KV slot.

``req_to_token[row, pos]`` (int64 [rows, max_context]) is the slot of token ``pos`` of the request
in ``row``. D in PD writes a row as ``[prefix slots (0..pre_len) | delta slots (pre_len..seq_len)]``.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, size: int, max_context: int, device: str | torch.device = "cpu"):
        self.size = size
        self.max_context = max_context
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context), dtype=torch.int64, device=self.device)
        self._free: list[int] = list(range(size - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.size - len(self._free)

    def alloc(self) -> int | None:
        """A free row index, or None when all rows are taken."""
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        if not 0 <= row < self.size or row in self._free:
            raise ValueError(f"free of request row {row}: out of range or already free")
        self._free.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """``req_to_token[row, start : start + len(slots)] = slots`` (int64 [N]).

        Raises ValueError for a row outside the pool or a range past ``max_context``.
        """
        if not isinstance(row, int) or not 0 <= row < self.size:
            raise ValueError(f"request row {row!r} outside [0, {self.size})")
        if start < 0 or start + slots.numel() > self.max_context:
            raise ValueError(f"positions [{start}, {start + slots.numel()}) outside the row (max_context {self.max_context})")
        self.req_to_token[row, start : start + slots.numel()] = slots.to(self.device)

    def slots(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots of positions ``[start, end)`` of ``row`` (int64 [end - start], a copy)."""
        return self.req_to_token[row, start:end].clone()
