"""Cases of the split-KV decode kernel (``engine.attention.split_kv_decode``) in Triton's CPU
interpreter (float16: the interpreter's numpy has no bfloat16) against the float32 torch reference.
Not collected by itself: ``test_split_kv_decode.py`` runs this file in a fresh process with
``TRITON_INTERPRET=1`` set before Triton is imported. The GPU comparison with flashinfer's decode
wrapper (bf16, in CUDA graphs) is ``python -m bench.gpu xqa_micro`` and the GPU tests."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.attention.split_kv_decode import SplitConfig, SplitKVDecode, num_splits, reference  # noqa: E402

PS = 4


def make(lens, H=8, KVH=2, D=16, page_major=True, seed=0, shuffle=True):
    """A pool with rows of ``lens`` tokens on shuffled pages (page-major strided views if asked)."""
    g = torch.Generator().manual_seed(seed)
    pages_per_row = [-(-n // PS) for n in lens]
    P = sum(pages_per_row) + 3
    if page_major:  # [pages, layers=2, 2, ps, kvh, D]: layer 1's K and V, strided like the engine's
        region = torch.randn(P, 2, 2, PS, KVH, D, generator=g).half()
        k, v = region[:, 1, 0], region[:, 1, 1]
    else:
        k = torch.randn(P, PS, KVH, D, generator=g).half()
        v = torch.randn(P, PS, KVH, D, generator=g).half()
    order = torch.randperm(P, generator=g) if shuffle else torch.arange(P)
    width = max(pages_per_row) * PS + 5
    r2t = torch.full((len(lens) + 2, width), 0, dtype=torch.int32)
    used = 0
    rows = torch.arange(len(lens), dtype=torch.int64) + 2  # rows 0, 1 unused: the row index is honoured
    for i, n in enumerate(lens):
        for t in range(n):
            r2t[rows[i], t] = int(order[used + t // PS]) * PS + t % PS
        used += pages_per_row[i]
    q_full = torch.randn(len(lens), H + 2 * KVH, D, generator=g).half()  # fused q/k/v rows: q is strided
    q = q_full[:, :H]
    return q, k, v, r2t, rows, torch.tensor(lens, dtype=torch.int64)


def run(lens, sms, cfg=SplitConfig(block_n=16, warps=4, stages=1), **kw):
    q, k, v, r2t, rows, seq = make(lens, **kw)
    H, KVH, D = q.shape[1], k.shape[2], q.shape[2]
    att = SplitKVDecode(H, KVH, D, PS, max_batch=len(lens), device="cpu", sms=sms, config=cfg)
    out = att(q, k, v, r2t, rows, seq)
    ref = reference(q, k, v, r2t, rows, seq)
    return att, out, ref


@pytest.mark.parametrize("lens,sms", [
    ([37], 1),          # one program: S = 1, direct write, a partial last tile
    ([37], 8),          # S = 8 chunks of 16: splits past the row's end are empty
    ([1], 16),          # one token, S = 16: all but one split empty
    ([100, 3, 64], 6),  # mixed lengths, S = 2
    ([250], 64),        # S = 32 (the cap), several tiles a chunk
])
def test_matches_the_float32_reference(lens, sms):
    att, out, ref = run(lens, sms)
    assert out.shape == ref.shape and out.dtype == torch.float16
    assert torch.allclose(out.float(), ref, rtol=2e-3, atol=2e-3), (out.float() - ref).abs().max()
    assert int(att.counter.abs().sum()) == 0  # every (request, head) counter reset for the next launch


def test_layer_major_pool_and_gqa_group_of_seven():
    att, out, ref = run([29, 50], 8, H=14, KVH=2, page_major=False)  # Qwen2.5-7B's group of 7
    assert torch.allclose(out.float(), ref, rtol=2e-3, atol=2e-3), (out.float() - ref).abs().max()


def test_repeated_launches_reuse_the_counters():
    q, k, v, r2t, rows, seq = make([45, 20])
    att = SplitKVDecode(8, 2, 16, PS, max_batch=2, device="cpu", sms=8, config=SplitConfig(block_n=16, stages=1))
    first = att(q, k, v, r2t, rows, seq).clone()
    second = att(q, k, v, r2t, rows, seq)
    assert torch.equal(first, second)


def test_tokens_past_seq_len_are_not_read():
    q, k, v, r2t, rows, seq = make([33])
    att = SplitKVDecode(8, 2, 16, PS, max_batch=1, device="cpu", sms=4, config=SplitConfig(block_n=16, stages=1))
    base = att(q, k, v, r2t, rows, seq).clone()
    used = {int(s) // PS for s in r2t[rows[0], :33]}
    spare = min(set(range(k.shape[0])) - used)  # a page the row does not own
    r2t[rows[0], 33:] = spare * PS  # what a chunk running past seq_len would read
    k[spare].fill_(100.0)
    v[spare].fill_(100.0)
    assert torch.equal(att(q, k, v, r2t, rows, seq), base)


def test_num_splits_fills_the_gpu_and_is_capped():
    assert num_splits(1, 8, 132, ctas_per_sm=2) == 32  # 2 * 132 / 8 = 33 -> the cap
    assert num_splits(8, 8, 132, ctas_per_sm=2) == 5
    assert num_splits(32, 8, 132, ctas_per_sm=2) == 2
    assert num_splits(64, 8, 132, ctas_per_sm=2) == 1
    assert num_splits(1, 8, 132) == 17
    assert num_splits(17, 8, 132) == 1


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="query heads"):
        SplitKVDecode(12, 5, 16, PS, 1, "cpu", sms=1)
    with pytest.raises(ValueError, match="query heads"):
        SplitKVDecode(68, 2, 16, PS, 1, "cpu", sms=1)  # a group of 34
    with pytest.raises(ValueError, match="head_dim"):
        SplitKVDecode(8, 2, 24, PS, 1, "cpu", sms=1)
