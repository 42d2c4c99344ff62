"""A ForwardBatch through the tensor-parallel batch message (engine/distributed/batch_wire.py):
every field, the logit index and each request's req_to_token row [0, seq_len) arrive as sent."""

from __future__ import annotations

import pytest
import torch

from engine.distributed.batch_wire import pack_batch, unpack_batch
from engine.forward_batch import ForwardBatch, ForwardMode

FIELDS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "prefix_lens", "extend_lens", "out_cache_loc",
          "seq_lens_cpu", "extend_lens_cpu")


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
@pytest.mark.parametrize("with_index", [False, True])
def test_round_trip(mode, with_index):
    src = torch.arange(6 * 40, dtype=torch.int64).reshape(6, 40) * 7
    if mode is ForwardMode.EXTEND:
        batch = ForwardBatch.build(mode, [4, 1], [3, 0], [[5, 6], [7, 8, 9]], torch.tensor([31, 32, 40, 41, 42]))
    else:
        batch = ForwardBatch.decode([2, 5, 0], [10, 0, 39], [1, 2, 3], src)
    index = torch.tensor([0, 2]) if with_index else None
    dst = torch.full_like(src, -1)
    got, got_index = unpack_batch(pack_batch(batch, index, src), dst)
    assert got.mode is mode
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(batch, f)), f
    assert (got_index is None) == (index is None) and (index is None or torch.equal(got_index, index))
    for row, s in zip(batch.req_pool_indices.tolist(), batch.seq_lens.tolist()):
        assert torch.equal(dst[row, :s], src[row, :s]) and (dst[row, s:] == -1).all()
    untouched = set(range(6)) - set(batch.req_pool_indices.tolist())
    assert all((dst[r] == -1).all() for r in untouched)


def test_a_short_message_is_refused():
    src = torch.zeros(2, 8, dtype=torch.int64)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [0], [0], [[1, 2]], torch.tensor([0, 1]))
    msg = pack_batch(batch, None, src)
    with pytest.raises(ValueError):
        unpack_batch(torch.cat([msg, torch.zeros(1, dtype=torch.int64)]), src.clone())
