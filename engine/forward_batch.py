"""ForwardBatch: what one model forward computes (an extend batch or a decode batch).

Tokens of all requests are packed request after request (ragged; no padding):

=================  ==============  ==================================================================
field              dtype / shape   meaning
=================  ==============  ==================================================================
mode               ForwardMode     EXTEND (prefill on top of a cached prefix, 0 allowed) or DECODE
input_ids          int64 [T]       new tokens
positions          int64 [T]       their positions (prefix_len .. seq_len-1 per request)
req_pool_indices   int64 [B]       each request's row in ``req_to_token``
seq_lens           int64 [B]       tokens per request after this forward (prefix + new)
prefix_lens        int64 [B]       tokens whose K/V are already in the pool (``pre_len``)
extend_lens        int64 [B]       new tokens per request (decode: all 1); sum == T
out_cache_loc      int64 [T]       slots to write the new tokens' K/V into
seq_lens_cpu       int64 [B] (CPU) host copy of ``seq_lens`` (GPU backends plan from it, no sync)
extend_lens_cpu    int64 [B] (CPU) host copy of ``extend_lens``
=================  ==============  ==================================================================

Rows of ``req_to_token`` must already hold ``out_cache_loc`` at positions ``[prefix_len, seq_len)``
(the attention backend reads the whole row ``[0, seq_len)``); :meth:`ForwardBatch.build` does not
write them, the caller does (``ReqToTokenPool.write``), so D can write its delta slots itself.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Sequence

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"


@dataclasses.dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens_cpu: torch.Tensor | None = None  # None: backends copy seq_lens to the host (a sync)
    extend_lens_cpu: torch.Tensor | None = None

    def host_lens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(seq_lens, extend_lens) as CPU int64 [B], without a device sync when ``build`` made them."""
        s = self.seq_lens_cpu if self.seq_lens_cpu is not None else self.seq_lens.cpu()
        e = self.extend_lens_cpu if self.extend_lens_cpu is not None else self.extend_lens.cpu()
        return s, e

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.numel())

    @classmethod
    def build(cls, mode: ForwardMode, rows: Sequence[int], prefix_lens: Sequence[int],
              token_ids: Sequence[Sequence[int]], out_cache_loc: torch.Tensor,
              device: str | torch.device = "cpu") -> "ForwardBatch":
        """Pack requests: ``token_ids[i]`` are request i's new tokens at positions ``prefix_lens[i]..``.

        Raises ValueError when the lengths do not agree or DECODE is given != 1 token per request.
        """
        ext = [len(t) for t in token_ids]
        if not (len(rows) == len(prefix_lens) == len(token_ids)):
            raise ValueError("rows, prefix_lens and token_ids must have one entry per request")
        if mode is ForwardMode.DECODE and any(e != 1 for e in ext):
            raise ValueError("a DECODE batch has exactly one new token per request")
        if any(e < 1 for e in ext):
            raise ValueError("every request needs at least one new token")
        if out_cache_loc.numel() != sum(ext):
            raise ValueError(f"out_cache_loc has {out_cache_loc.numel()} slots for {sum(ext)} tokens")
        flat = [t for ts in token_ids for t in ts]
        pos = [p for pre, e in zip(prefix_lens, ext) for p in range(pre, pre + e)]
        dev = torch.device(device)
        i64 = dict(dtype=torch.int64, device=dev)
        seq = [p + e for p, e in zip(prefix_lens, ext)]
        return cls(
            mode=mode,
            input_ids=torch.tensor(flat, **i64),
            positions=torch.tensor(pos, **i64),
            req_pool_indices=torch.tensor(list(rows), **i64),
            seq_lens=torch.tensor(seq, **i64),
            prefix_lens=torch.tensor(list(prefix_lens), **i64),
            extend_lens=torch.tensor(ext, **i64),
            out_cache_loc=out_cache_loc.to(dev, torch.int64),
            seq_lens_cpu=torch.tensor(seq, dtype=torch.int64),
            extend_lens_cpu=torch.tensor(ext, dtype=torch.int64),
        )

    @classmethod
    def decode(cls, rows: Sequence[int], kv_lens: Sequence[int], last_tokens: Sequence[int],
               req_to_token: torch.Tensor) -> "ForwardBatch":
        """A DECODE batch with one host-to-device copy: request i feeds ``last_tokens[i]`` at position
        ``kv_lens[i]`` of row ``rows[i]``, whose slot ``req_to_token[rows[i], kv_lens[i]]`` must already
        be written there (D reserves every slot up front); it is gathered on ``req_to_token``'s device,
        so the caller does not index the table per request. Same fields as :meth:`build` gives.

        Args:
            rows: B ``req_to_token`` rows (ints).
            kv_lens: B lengths in tokens: the K/V already in the pool per request (= the fed token's
                position; ``seq_lens`` = ``kv_lens + 1`` and ``prefix_lens`` = ``kv_lens``).
            last_tokens: B token ids fed this step (the overlap schedule passes placeholders and then
                writes ``input_ids`` on the device).
            req_to_token: int64 ``[rows, max_context]`` slot table (``ReqToTokenPool.req_to_token``); its
                device is the batch's device.
        Returns:
            A DECODE ForwardBatch: ``input_ids``, ``positions`` (= ``prefix_lens``, the same tensor),
            ``seq_lens``, ``extend_lens`` (all 1) and ``req_pool_indices`` are int64 [B] views of one
            device copy (of the host tensor itself on CPU); ``out_cache_loc`` int64 [B]; the ``*_cpu``
            fields are int64 [B] host tensors.
        Raises:
            ValueError: the three lists differ in length, or B == 0.
        """
        B = len(rows)
        if not (B == len(kv_lens) == len(last_tokens)) or B == 0:
            raise ValueError("rows, kv_lens and last_tokens need one entry per request (and at least one)")
        host = torch.empty(5, B, dtype=torch.int64)
        host[0] = torch.as_tensor(rows, dtype=torch.int64)
        host[1] = torch.as_tensor(kv_lens, dtype=torch.int64)
        host[2] = torch.as_tensor(last_tokens, dtype=torch.int64)
        torch.add(host[1], 1, out=host[3])
        host[4] = 1
        dev = req_to_token.device
        d = host.to(dev, non_blocking=True) if dev.type != "cpu" else host
        rows_d, pos_d = d[0], d[1]
        return cls(mode=ForwardMode.DECODE, input_ids=d[2], positions=pos_d, req_pool_indices=rows_d,
                   seq_lens=d[3], prefix_lens=pos_d, extend_lens=d[4],
                   out_cache_loc=req_to_token[rows_d, pos_d], seq_lens_cpu=host[3], extend_lens_cpu=host[4])
