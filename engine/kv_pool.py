"""KV pool: per-layer K and V buffers of ``[num_pages * page_size, num_kv_heads, head_dim]``.

Slot ``s`` of layer ``l`` is ``k_buffers[l][s]`` / ``v_buffers[l][s]``; page ``p`` covers slots
``[p * page_size, (p + 1) * page_size)``, which is ``page_bytes`` contiguous bytes in each buffer.
The transfer engine registers :meth:`buffers` (``[K_0, V_0, K_1, V_1, ...]``, each contiguous,
``data_ptr()`` stable for the pool's life) and moves page ``p`` of buffer ``b`` as the byte range
``[buf.data_ptr() + p * page_bytes, + page_bytes)``.
"""

from __future__ import annotations

import torch

from engine.config import parse_bytes


def available_memory(device: torch.device) -> int:
    """Free bytes on ``device`` (CUDA: ``mem_get_info``; CPU: ``MemAvailable`` of /proc/meminfo)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def pages_for_budget(budget, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device: torch.device) -> int:
    """Number of pages a budget buys: bytes, ``"2GiB"``, or a fraction in (0, 1] of free memory.

    One page costs ``2 * num_layers * page_size * num_kv_heads * head_dim * itemsize`` bytes.
    """
    b = parse_bytes(budget)
    if isinstance(b, float):
        if not 0 < b <= 1:
            raise ValueError(f"kv_memory: fraction {b} outside (0, 1]")
        b = int(available_memory(device) * b)
    per_page = 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
    n = int(b) // per_page
    if n < 1:
        raise ValueError(f"kv_memory: {b} bytes is less than one page ({per_page} bytes)")
    return n


class KVPool:
    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu"):
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        n = num_pages * page_size
        shape = (n, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in one buffer (``page_size * num_kv_heads * head_dim * itemsize``)."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.k_buffers[0].element_size()

    @property
    def total_bytes(self) -> int:
        return 2 * self.num_layers * self.num_pages * self.page_bytes

    def buffers(self) -> list[torch.Tensor]:
        """``[K_0, V_0, K_1, V_1, ...]`` (the order the transfer engine registers and addresses)."""
        out = []
        for k, v in zip(self.k_buffers, self.v_buffers):
            out += [k, v]
        return out

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V (``[N, kv_heads, head_dim]``) at ``slots`` (int64 [N])."""
        self.k_buffers[layer][slots] = k.to(self.dtype)
        self.v_buffers[layer][slots] = v.to(self.dtype)
