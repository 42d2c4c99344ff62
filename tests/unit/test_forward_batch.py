"""ForwardBatch.decode (one host->device copy, slots gathered from req_to_token) builds the same batch
as ForwardBatch.build with the slots indexed by hand."""

from __future__ import annotations

import pytest
import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.kvcache.req_to_token_pool import ReqToTokenPool


def test_decode_batch_equals_build():
    r2t = ReqToTokenPool(6, 32, "cpu")
    g = torch.Generator().manual_seed(0)
    for row in range(6):
        r2t.write(row, 0, torch.randperm(500, generator=g)[:32])
    rows, kv_lens, last = [4, 0, 2], [7, 31, 0], [11, 12, 13]
    want = ForwardBatch.build(ForwardMode.DECODE, rows, kv_lens, [[t] for t in last],
                              torch.stack([r2t.req_to_token[r, n] for r, n in zip(rows, kv_lens)]))
    got = ForwardBatch.decode(rows, kv_lens, last, r2t.req_to_token)
    assert got.mode is ForwardMode.DECODE
    for f in ("input_ids", "positions", "req_pool_indices", "seq_lens", "prefix_lens", "extend_lens",
              "out_cache_loc", "seq_lens_cpu", "extend_lens_cpu"):
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype == torch.int64 and a.tolist() == b.tolist(), f
    assert got.out_cache_loc.tolist() == [int(r2t.req_to_token[r, n]) for r, n in zip(rows, kv_lens)]


def test_decode_batch_rejects_mismatched_lists():
    r2t = ReqToTokenPool(2, 8, "cpu")
    with pytest.raises(ValueError, match="one entry per request"):
        ForwardBatch.decode([0, 1], [3], [5, 6], r2t.req_to_token)
    with pytest.raises(ValueError, match="at least one"):
        ForwardBatch.decode([], [], [], r2t.req_to_token)
