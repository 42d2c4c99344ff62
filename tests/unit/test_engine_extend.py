"""Extend on a cached prefix gives the same logits as a full prefill (max abs diff <= 1e-4), for
prefix lengths 0, one page, several pages and all-but-one token, page sizes 1, 4 and 16; the
prefix is either computed in the same row or shared page by page from another request's row (the
radix-cache / PD decode layout ``[prefix slots | delta slots]``). Also ragged decode batches.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.model_runner import ModelRunner

N = 50  # prompt tokens
ATOL = 1e-4


@pytest.fixture(scope="module")
def base(model_dir):
    r = ModelRunner(EngineConfig(model=str(model_dir), page_size=16, num_pages=64, max_running_requests=4,
                                 max_context=256))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, r.vocab_size, (N,), generator=g).tolist()
    return r, ids


def _runner(base, ps):
    r, _ = base
    return ModelRunner(EngineConfig(model=str(r.model_path), page_size=ps, num_pages=1024 // ps + 8,
                                    max_running_requests=16, max_context=256), loaded=(r.model, r.model_path))


def _prefill(r, ids, pre=0, row=None, pre_slots=None):
    """Prefill ids[pre:] into a fresh row; its first `pre` positions use pre_slots (already filled)."""
    row = r.req_to_token_pool.alloc() if row is None else row
    if pre_slots is not None:
        r.req_to_token_pool.write(row, 0, pre_slots)
    last = int(pre_slots[-1]) if pre_slots is not None and pre else None
    slots = r.allocator.alloc_slots(pre, len(ids), last)
    r.req_to_token_pool.write(row, pre, slots)
    logits = r.forward(ForwardBatch.build(ForwardMode.EXTEND, [row], [pre], [ids[pre:]], slots))
    return row, logits[0]


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_extend_on_prefix_equals_full_prefill(base, ps):
    r = _runner(base, ps)
    ids = base[1]
    row_full, want = _prefill(r, ids)
    full_slots = r.req_to_token_pool.slots(row_full, 0, N)
    for pre in sorted({0, ps, 3 * ps, N - 1}):
        # (a) the prefix computed earlier in the same row, then the rest extended on top of it
        row = r.req_to_token_pool.alloc()
        if pre:
            _prefill(r, ids[:pre], row=row)
        _, got = _prefill(r, ids, pre=pre, row=row, pre_slots=r.req_to_token_pool.slots(row, 0, pre) if pre else None)
        assert (got - want).abs().max().item() <= ATOL, (ps, pre)
        # (b) page-aligned prefix shared with the full request's row (radix hit): only the delta is computed
        if pre % ps == 0 and pre:
            _, got = _prefill(r, ids, pre=pre, pre_slots=full_slots[:pre])
            assert (got - want).abs().max().item() <= ATOL, (ps, pre, "shared")
    assert r.allocator.num_free + r.allocator.num_used == r.allocator.num_pages


def test_ragged_decode_batch_equals_full_prefill(base):
    r = _runner(base, 4)
    ids = base[1]
    lens = [5, 17, 32, N - 1]  # ragged; one page-aligned so its decode token opens a new page
    rows, slots = [], []
    for n in lens:
        row, _ = _prefill(r, ids[:n])
        rows.append(row)
        slots.append(int(r.req_to_token_pool.req_to_token[row, n - 1]))
    new = []
    for row, n, last in zip(rows, lens, slots):
        s = r.allocator.alloc_slots(n, n + 1, last)
        r.req_to_token_pool.write(row, n, s)
        new.append(s)
    got = r.forward(ForwardBatch.build(ForwardMode.DECODE, rows, lens, [[ids[n]] for n in lens], torch.cat(new)))
    for i, n in enumerate(lens):
        r2 = _runner(base, 4)
        _, want = _prefill(r2, ids[: n + 1])
        assert (got[i] - want).abs().max().item() <= ATOL, n
