"""The ``cpu_paged`` attention backend: decode through a C++ kernel that reads the KV pool in place.

Decode (one new token per request): the step's K/V are stored and attended in one kernel call
(``store_and_decode``: the same bytes as ``KVPool.write``). :meth:`init_forward` builds the page table int32 ``[B,
max_pages]`` (page ``j`` of row ``b`` = ``req_to_token[row, j * page_size] // page_size``, docs/
architecture.md "KV memory") and ``seq_lens`` int32 ``[B]`` once per step; every layer then calls
``paged_decode`` (``csrc/paged_decode.cpp``: flash-decoding over (request, split) work items, each
page read once for all q heads, online softmax in fp32) on ``kv_pool.k_pages(layer)`` and
``v_pages(layer)`` as they lie (either layout: only the strides differ). No page is copied and no
row is padded to the longest. The result equals the reference SDPA within fp32 rounding (another
summation order: tests/unit/test_attention_cpu_paged.py), not bit for bit.

Extend and prefill stay on ``torch_paged``'s path. The kernel is built once per machine
(``engine/cpu_kernels.py``); this backend raises when it is missing, ``auto`` then picks
``torch_paged`` and says why (``engine/attention/__init__.py``).
"""

from __future__ import annotations

import torch

from engine.cpu_kernels import PAGED_DECODE
from engine.attention.torch_paged_backend import TorchPagedAttentionBackend
from engine.forward_batch import ForwardBatch, ForwardMode

KV_DTYPES = (torch.float32, torch.bfloat16)


def kernel_unavailable(device: torch.device, dtype: torch.dtype) -> str:
    """Why ``cpu_paged`` cannot serve a pool on ``device`` of ``dtype`` ("" when it can)."""
    if torch.device(device).type != "cpu":
        return f"cpu_paged needs a CPU pool, not {torch.device(device).type}"
    if dtype not in KV_DTYPES:
        return f"cpu_paged supports float32 and bfloat16 pools, not {dtype}"
    return PAGED_DECODE.load()[1]


class CpuPagedAttentionBackend(TorchPagedAttentionBackend):
    """Raises ValueError("attention_backend: cpu_paged: ...") when the kernel cannot serve the pool."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        why = kernel_unavailable(self.kv_pool.device, self.kv_pool.dtype)
        if why:
            raise ValueError(f"attention_backend: cpu_paged: {why}")
        self._kernel = PAGED_DECODE.load()[0]

    def init_forward(self, batch: ForwardBatch) -> None:
        if batch.mode is not ForwardMode.DECODE:
            return super().init_forward(batch)
        r2t = self.req_to_token_pool.req_to_token
        ps = self.kv_pool.page_size
        seq_host, _ = batch.host_lens()
        n_pages = -(-int(seq_host.max()) // ps)
        first = r2t[batch.req_pool_indices.to(r2t.device)[:, None], torch.arange(0, n_pages * ps, ps)[None, :]]
        own = torch.arange(n_pages)[None, :] < ((seq_host + ps - 1) // ps)[:, None]  # [B, Lp]
        # entries past a row's own pages are never read; 0 keeps the table in range
        self._table = torch.where(own, first // ps, 0).to(torch.int32).contiguous()
        self._lens = seq_host.to(torch.int32).contiguous()
        # rows are cut in pieces only when requests (one work item each) cannot occupy every thread
        self._splits = max(1, min(-(-torch.get_num_threads() // batch.batch_size), n_pages))

    def forward(self, q, k, v, layer, batch):
        if batch.mode is not ForwardMode.DECODE:
            return super().forward(q, k, v, layer, batch)
        pool = self.kv_pool
        # KVPool.write's store and the kernel in one call (q, k, v may be views of a fused q/k/v row)
        return self._kernel.store_and_decode(q, k, v, pool.k_pages(layer), pool.v_pages(layer), batch.out_cache_loc,
                                             self._table, self._lens, self.scale, self._splits)
