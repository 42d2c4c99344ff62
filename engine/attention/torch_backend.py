"""The ``torch`` attention backend: gather each request's pages via ``req_to_token`` and run masked
``scaled_dot_product_attention``. Works on any device; it is the reference the others are tested
against. Extend runs one SDPA per request (ragged lengths; causal kernel on the new K/V when there is
no cached prefix, else a gather of the row and a mask); decode pads the batch to the longest
sequence and masks the tail.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.forward_batch import ForwardBatch, ForwardMode


class TorchAttentionBackend(AttentionBackend):
    def init_forward(self, batch: ForwardBatch) -> None:
        r2t = self.req_to_token_pool.req_to_token
        dev = r2t.device
        seq = batch.seq_lens.tolist()
        if batch.mode is ForwardMode.DECODE:
            L = max(seq)
            self._idx = r2t[batch.req_pool_indices.to(dev), :L]  # [B, L]
            ar = torch.arange(L, device=dev)
            self._mask = (ar[None, :] < batch.seq_lens.to(dev)[:, None])[:, None, None, :]  # [B,1,1,L]
        else:
            self._reqs = []
            start = 0
            for row, pre, ext, s in zip(batch.req_pool_indices.tolist(), batch.prefix_lens.tolist(),
                                        batch.extend_lens.tolist(), seq):
                if pre == 0:  # no cached prefix: attend to the new K/V directly, causal SDPA kernel
                    self._reqs.append((start, start + ext, None, None))
                else:
                    slots = r2t[row, :s]
                    q_pos = torch.arange(pre, pre + ext, device=dev)
                    mask = torch.arange(s, device=dev)[None, :] <= q_pos[:, None]  # [E, S]
                    self._reqs.append((start, start + ext, slots, mask))
                start += ext

    def forward(self, q, k, v, layer, batch):
        pool = self.kv_pool
        self.store_kv(layer, batch, k, v)
        H, D = self.num_heads, self.head_dim
        if batch.mode is ForwardMode.DECODE:
            kk, vv = pool.read(layer, self._idx)  # [B, L, kvh, D]
            kk, vv = kk.transpose(1, 2).to(q.dtype), vv.transpose(1, 2).to(q.dtype)  # [B, kvh, L, D]
            out = F.scaled_dot_product_attention(q[:, :, None, :], kk, vv, attn_mask=self._mask,
                                                 scale=self.scale, enable_gqa=True)  # [B, H, 1, D]
            return out.reshape(q.shape[0], H * D)
        outs = []
        for s, e, slots, mask in self._reqs:
            qq = q[s:e].transpose(0, 1)[None]  # [1, H, E, D]
            if slots is None:
                kk, vv = k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                kk, vv = self._prefix_kv(layer, slots)  # [S, kvh, D]
                kk, vv = kk.transpose(0, 1)[None].to(q.dtype), vv.transpose(0, 1)[None].to(q.dtype)  # [1, kvh, S, D]
                o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask[None, None], scale=self.scale,
                                                   enable_gqa=True)
            outs.append(o[0].transpose(0, 1).reshape(e - s, H * D))
        return torch.cat(outs, 0)

    def _prefix_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[S, kvh, D]`` of one extend request's whole row (``slots`` int64 [S], what
        :meth:`init_forward` stored for it)."""
        return self.kv_pool.read(layer, slots)
