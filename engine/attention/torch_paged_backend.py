"""The ``torch_paged`` attention backend: the ``torch`` backend with a page-level decode gather.

Decode (one new token per request) reads each request's K/V as whole pages: :meth:`init_forward`
builds the page table ``[B, Lp]`` once per step (``Lp`` = pages of the longest row; token ``j`` of a
row sits at offset ``j % page_size`` of page ``req_to_token[row, j - j % page_size] // page_size``,
docs/architecture.md "KV memory"), shared by every layer; each layer then copies ``B * Lp`` pages
of K and of V with one ``index_select`` each (contiguous ``page_size * kv_heads * head_dim`` runs)
instead of the reference backend's token-level ``[page, offset]`` gather, into two page buffers
that every layer reuses (grow-only, sized by the largest step so far: a 5 MB allocation per layer
per step otherwise goes to ``mmap`` and page faults whenever glibc's threshold sits below it). Page-table entries past a
row's own pages point at page 0 and are masked; the tail of the last page past the longest row is
sliced off (a view), so SDPA sees the reference's shapes.

Extend requests with a cached prefix read their row ``[0, seq_len)`` the same way (whole pages,
then the first ``seq_len`` tokens). The attention itself is the reference backend's masked GQA
SDPA on the same values and shapes, so the output is bit-identical to ``torch``
(tests/unit/test_attention_paged.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.torch_backend import TorchAttentionBackend
from engine.forward_batch import ForwardBatch, ForwardMode


class TorchPagedAttentionBackend(TorchAttentionBackend):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._gather = None  # (K, V) page buffers [pages, page_size, kv_heads, head_dim], reused by every layer

    def init_forward(self, batch: ForwardBatch) -> None:
        if batch.mode is not ForwardMode.DECODE:
            super().init_forward(batch)
            ps = self.kv_pool.page_size
            self._reqs = [(s, e, None if slots is None else (slots[::ps] // ps, slots.numel()), mask)
                          for s, e, slots, mask in self._reqs]
            return
        r2t = self.req_to_token_pool.req_to_token
        dev = r2t.device
        ps = self.kv_pool.page_size
        seq_host, _ = batch.host_lens()
        n_pages = -(-int(seq_host.max()) // ps)
        seq = batch.seq_lens.to(dev)
        first = r2t[batch.req_pool_indices.to(dev)[:, None], torch.arange(0, n_pages * ps, ps, device=dev)[None, :]]
        own = torch.arange(n_pages, device=dev)[None, :] < ((seq + ps - 1) // ps)[:, None]  # [B, Lp]
        self._pages = torch.where(own, first // ps, 0).reshape(-1)  # [B * Lp]
        n = self._pages.numel()
        if self._gather is None or self._gather[0].shape[0] < n:  # grow-only: no allocation per layer
            page = self.kv_pool.k_pages(0).shape[1:]
            self._gather = tuple(torch.empty((n,) + page, dtype=self.kv_pool.dtype, device=dev) for _ in range(2))
        self._shape = (batch.batch_size, n_pages * ps, self.kv_pool.num_kv_heads, self.head_dim)
        # attend over L = the longest row, as the reference does (same lengths: same summation order)
        self._len = int(seq_host.max())
        ar = torch.arange(self._len, device=dev)
        self._mask = (ar[None, :] < seq[:, None])[:, None, None, :]  # [B, 1, 1, L]

    def _prefix_kv(self, layer, key):
        pages, n = key  # the row's pages int64 [ceil(n / page_size)], its length in tokens
        shape = (-1, self.kv_pool.num_kv_heads, self.head_dim)
        return (self.kv_pool.k_pages(layer).index_select(0, pages).view(shape)[:n],
                self.kv_pool.v_pages(layer).index_select(0, pages).view(shape)[:n])

    def forward(self, q, k, v, layer, batch):
        if batch.mode is not ForwardMode.DECODE:
            return super().forward(q, k, v, layer, batch)
        pool = self.kv_pool
        self.store_kv(layer, batch, k, v)
        L, n = self._len, self._pages.numel()
        kb, vb = self._gather[0][:n], self._gather[1][:n]
        torch.index_select(pool.k_pages(layer), 0, self._pages, out=kb)
        torch.index_select(pool.v_pages(layer), 0, self._pages, out=vb)
        kk = kb.view(self._shape)[:, :L].transpose(1, 2).to(q.dtype)
        vv = vb.view(self._shape)[:, :L].transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(q[:, :, None, :], kk, vv, attn_mask=self._mask,
                                             scale=self.scale, enable_gqa=True)  # [B, H, 1, D]
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
