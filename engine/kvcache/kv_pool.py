"""KV pool: the K and V of every layer for ``num_pages`` pages of ``page_size`` tokens.

Slot ``s`` is token ``s % page_size`` of page ``s // page_size``. Attention sees, per layer, K and V
as ``[num_pages, page_size, num_kv_heads, head_dim]`` tensors (:meth:`KVPool.k_pages`,
:meth:`KVPool.v_pages`); how those views sit in memory is the pool's ``layout``:

``page_major`` (the default; docs/architecture.md, KV memory): one tensor ``[num_pages, num_layers, 2, page_size,
    num_kv_heads, head_dim]`` (K then V of layer 0, K then V of layer 1, ... inside a page). The
    per-layer views are strided (page stride ``2 * num_layers * page_size * num_kv_heads * head_dim``
    elements). A page is ONE contiguous byte range of ``page_stride_bytes``, and a run of n
    consecutive pages is one range of ``n * page_stride_bytes``: a transfer moves a run in one put
    whatever the number of layers. :meth:`KVPool.buffers` is ``[region]``.
``layer_major``: one contiguous ``[num_pages, page_size, num_kv_heads, head_dim]`` tensor per layer
    per K/V; :meth:`KVPool.buffers` is ``[K_0, V_0, K_1, V_1, ...]`` and a run of pages is one range in
    each of the ``2 * num_layers`` buffers.

Either way page ``p`` of buffer ``b`` (``b = 2 * layer + (0 for K, 1 for V)``) is the ``page_bytes``
range starting at ``buffers()[0].data_ptr() + p * page_stride_bytes + b * page_bytes`` (page_major)
or ``buffers()[b].data_ptr() + p * page_bytes`` (layer_major); ``data_ptr()`` is stable for the
pool's life. This is what ``prefill_svc.kv_runs.PoolGeometry`` and ``registry.proto`` ``KVLayout``
describe.
"""

from __future__ import annotations

import torch

from engine.config import parse_bytes

KV_LAYOUTS = ("page_major", "layer_major")


def available_memory(device: torch.device) -> int:
    """Free bytes on ``device`` (CUDA: ``mem_get_info``; CPU: ``MemAvailable`` of /proc/meminfo).
    Raises RuntimeError when /proc/meminfo has no MemAvailable line."""
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

    Raises:
        ValueError: a fraction outside (0, 1], or a budget below one page (messages name kv_memory).
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
    """K/V storage of ``num_pages`` pages for ``num_layers`` layers (layouts: module docstring).

    Args:
        num_pages, page_size: pages, and tokens per page.
        num_layers, num_kv_heads, head_dim: the model's KV shape.
        dtype, device: of every K/V element (zero-initialised).
        layout: ``"page_major"`` or ``"layer_major"``.
    Attributes:
        k_buffers, v_buffers: per-layer K / V views ``[num_pages, page_size, num_kv_heads, head_dim]``
            (``k_pages(layer)`` is ``k_buffers[layer]``; index them by page and offset, not by slot).
        region: page_major's one ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]``
            tensor (None in layer_major).
    Raises:
        ValueError: an unknown layout (the message names ``kv_layout``).
    """

    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                 layout: str = "page_major"):
        if layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout: must be one of {KV_LAYOUTS}, got {layout!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.layout = layout
        page = (page_size, num_kv_heads, head_dim)
        if layout == "page_major":
            self.region = torch.zeros((num_pages, num_layers, 2) + page, dtype=dtype, device=self.device)
            self.k_buffers = [self.region[:, layer, 0] for layer in range(num_layers)]  # strided views
            self.v_buffers = [self.region[:, layer, 1] for layer in range(num_layers)]
        else:
            self.region = None
            self.k_buffers = [torch.zeros((num_pages,) + page, dtype=dtype, device=self.device)
                              for _ in range(num_layers)]
            self.v_buffers = [torch.zeros((num_pages,) + page, dtype=dtype, device=self.device)
                              for _ in range(num_layers)]

    def k_pages(self, layer: int) -> torch.Tensor:
        """K of ``layer``: ``[num_pages, page_size, num_kv_heads, head_dim]`` (a view; strided in
        page_major, contiguous in layer_major). ``k_buffers[layer]`` is the same tensor."""
        return self.k_buffers[layer]

    def v_pages(self, layer: int) -> torch.Tensor:
        """V of ``layer``, shaped and laid out like :meth:`k_pages`."""
        return self.v_buffers[layer]

    @property
    def num_slots(self) -> int:
        """KV slots (tokens) the pool holds: ``num_pages * page_size``."""
        return self.num_pages * self.page_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one buffer (one layer's K or V): ``page_size * num_kv_heads *
        head_dim * itemsize``."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.k_buffers[0].element_size()

    @property
    def page_stride_bytes(self) -> int:
        """Bytes from page p to page p + 1 inside a registered buffer: ``2 * num_layers * page_bytes``
        (page_major: a whole page, every layer's K and V) or ``page_bytes`` (layer_major)."""
        return 2 * self.num_layers * self.page_bytes if self.layout == "page_major" else self.page_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of K and V of every layer and page (either layout): ``2 * num_layers * num_pages *
        page_bytes``."""
        return 2 * self.num_layers * self.num_pages * self.page_bytes

    def buffers(self) -> list[torch.Tensor]:
        """The contiguous tensors the transfer engine registers, in the order ``KVLayout.buffer_addrs``
        lists them: ``[region]`` (page_major, ``total_bytes`` long) or ``[K_0, V_0, K_1, V_1, ...]``
        (layer_major, ``num_pages * page_bytes`` each)."""
        if self.region is not None:
            return [self.region]
        out = []
        for k, v in zip(self.k_buffers, self.v_buffers):
            out += [k, v]
        return out

    def locate(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset in page) of each slot (int64 tensors shaped like ``slots``): what
        :meth:`write` indexes with, computable once for all layers of a forward."""
        return slots // self.page_size, slots % self.page_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              loc: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Store new tokens' K/V (``[N, num_kv_heads, head_dim]``, cast to the pool dtype) at ``slots``
        (int64 [N], on the pool's device); ``loc``: ``locate(slots)`` when the caller has it."""
        page, off = loc if loc is not None else self.locate(slots)
        self.k_buffers[layer][page, off] = k.to(self.dtype)
        self.v_buffers[layer][page, off] = v.to(self.dtype)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K and V of pages ``src`` into pages ``dst`` (int64 [N] page ids each,
        any device; distinct ``dst`` pages, none of them in ``src``): one index copy per buffer."""
        src, dst = src.to(self.device), dst.to(self.device)
        for buf in self.buffers():
            buf.index_copy_(0, dst, buf.index_select(0, src))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` at ``slots`` (int64, any shape S): two new ``[*S, num_kv_heads,
        head_dim]`` tensors in the pool dtype (a gather, for the torch attention backend)."""
        page, off = slots // self.page_size, slots % self.page_size
        return self.k_buffers[layer][page, off], self.v_buffers[layer][page, off]
