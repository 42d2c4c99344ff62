"""Page allocator, request-row pool and KV pool: random alloc/free sequences keep free + used =
total, slots keep offset = position % page_size, buffers expose the layout the transfer engine uses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import parse_bytes
from engine.kvcache.kv_pool import KVPool, pages_for_budget
from engine.kvcache.page_allocator import PageAllocator
from engine.kvcache.req_to_token_pool import ReqToTokenPool


@settings(max_examples=60, deadline=None)
@given(ps=st.sampled_from([1, 4, 16]), num_pages=st.integers(1, 40),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 12), st.integers(0, 1000)), max_size=60))
def test_allocator_random_sequences(ps, num_pages, ops):
    a = PageAllocator(num_pages, ps)
    held: list[list[int]] = []
    for is_alloc, n, pick in ops:
        if is_alloc:
            got = a.alloc(n)
            if n > a.num_free + (len(got) if got else 0):
                assert got is None
            else:
                assert got is not None and len(got) == n
                held.append(got)
        elif held:
            a.free(held.pop(pick % len(held)))
        owned = [p for h in held for p in h]
        assert len(set(owned)) == len(owned)  # never handed out twice
        assert a.num_free + a.num_used == num_pages
        assert a.num_used == len(owned)
    for h in held:
        a.free(h)
    assert a.num_free == num_pages


@settings(max_examples=60, deadline=None)
@given(ps=st.sampled_from([1, 4, 16]), steps=st.lists(st.integers(1, 20), min_size=1, max_size=12))
def test_alloc_slots_growth_keeps_offsets(ps, steps):
    a = PageAllocator(64, ps)
    row: list[int] = []
    for n in steps:
        s = a.alloc_slots(len(row), len(row) + n, row[-1] if row else None)
        if s is None:
            assert a.pages_needed(len(row), len(row) + n) > a.num_free
            break
        row += s.tolist()
    pos = torch.arange(len(row))
    slots = torch.tensor(row, dtype=torch.int64)
    assert bool((slots % ps == pos % ps).all())  # position p at offset p % page_size
    assert len(set(row)) == len(row)
    assert a.num_used == -(-len(row) // ps)
    a.free_slots(slots)
    assert a.num_free == 64


def test_allocator_errors():
    a = PageAllocator(4, 2)
    p = a.alloc(2)
    a.free(p)
    with pytest.raises(ValueError):
        a.free(p)  # double free
    with pytest.raises(ValueError):
        a.free([7])
    assert a.alloc(5) is None and a.num_free == 4
    with pytest.raises(ValueError):
        a.free([0, 0])  # duplicate in one call frees nothing
    assert a.num_free == 4


def test_req_to_token_pool():
    r = ReqToTokenPool(2, 8)
    a, b = r.alloc(), r.alloc()
    assert r.alloc() is None and r.num_used == 2
    r.write(a, 2, torch.tensor([5, 6, 7]))
    assert r.slots(a, 2, 5).tolist() == [5, 6, 7]
    with pytest.raises(ValueError):
        r.write(a, 6, torch.tensor([1, 2, 3]))  # past max_context
    r.free(a)
    with pytest.raises(ValueError):
        r.free(a)
    r.free(b)
    assert r.num_free == 2


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).flatten()


@pytest.mark.parametrize("layout", ["page_major", "layer_major"])
def test_kv_pool_write_read_round_trip(layout):
    P, ps, L, kvh, hd = 6, 4, 3, 2, 8
    pool = KVPool(P, ps, L, kvh, hd, torch.float32, layout=layout)
    assert all(pool.k_pages(i).shape == (P, ps, kvh, hd) and pool.v_pages(i).shape == (P, ps, kvh, hd)
               for i in range(L))
    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([3, 4, 5, 17, 22, 9])           # across page boundaries, unordered
    for layer in range(L):
        k, v = torch.randn(6, kvh, hd, generator=g), torch.randn(6, kvh, hd, generator=g)
        pool.write(layer, slots, k, v)
        rk, rv = pool.read(layer, slots)
        assert torch.equal(rk, k) and torch.equal(rv, v)
        rk2, _ = pool.read(layer, slots.view(2, 3))      # any index shape
        assert torch.equal(rk2, k.view(2, 3, kvh, hd))
        assert torch.equal(pool.k_pages(layer)[4, 1], k[3])  # slot 17 = page 4, offset 1
        assert torch.equal(pool.v_pages(layer)[5, 2], v[4])  # slot 22 = page 5, offset 2
    # every written slot holds data, every other slot of every layer is still zero
    written = set(slots.tolist())
    for layer in range(L):
        nz = pool.k_pages(layer).abs().sum((-1, -2)).flatten().nonzero().flatten().tolist()
        assert set(nz) == written


def test_kv_pool_page_major_page_is_one_contiguous_range():
    P, ps, L, kvh, hd = 5, 4, 3, 2, 8
    pool = KVPool(P, ps, L, kvh, hd, torch.float32, layout="page_major")
    bufs = pool.buffers()
    assert len(bufs) == 1 and bufs[0].is_contiguous()
    region = bufs[0]
    assert region.numel() * region.element_size() == pool.total_bytes == 2 * L * P * pool.page_bytes
    assert pool.page_bytes == ps * kvh * hd * 4
    assert pool.page_stride_bytes == 2 * L * pool.page_bytes
    for layer in range(L):  # per-layer views are strided over the one region
        assert pool.k_pages(layer).data_ptr() == region.data_ptr() + 2 * layer * pool.page_bytes
        assert pool.v_pages(layer).stride(0) == pool.page_stride_bytes // 4
    for layer in range(L):
        pool.write(layer, torch.arange(12, 16), torch.full((4, kvh, hd), 10.0 * layer + 1),
                   torch.full((4, kvh, hd), 10.0 * layer + 2))
    # page 3 is the byte range [ptr + 3 * page_stride_bytes, + page_stride_bytes): K_0 V_0 K_1 V_1 ...
    raw = _bytes(region)[3 * pool.page_stride_bytes:4 * pool.page_stride_bytes].view(torch.float32)
    want = torch.cat([torch.full((ps * kvh * hd,), 10.0 * layer + kv + 1)  # buffer b = 2 * layer + kv
                      for layer in range(L) for kv in (0, 1)])
    assert torch.equal(raw, want)
    assert _bytes(region)[:3 * pool.page_stride_bytes].count_nonzero() == 0  # pages 0-2 untouched
    assert _bytes(region)[4 * pool.page_stride_bytes:].count_nonzero() == 0


def test_kv_pool_layer_major_buffers():
    pool = KVPool(5, 4, 3, 2, 8, torch.float32, layout="layer_major")
    bufs = pool.buffers()
    assert len(bufs) == 6 and bufs[0] is pool.k_pages(0) and bufs[1] is pool.v_pages(0)
    assert all(b.is_contiguous() and b.shape == (5, 4, 2, 8) for b in bufs)
    assert pool.page_bytes == pool.page_stride_bytes == 4 * 2 * 8 * 4
    assert pool.total_bytes == 6 * 5 * pool.page_bytes
    # page p of buffer b is the byte range [ptr + p*page_bytes, + page_bytes)
    k = torch.randn(4, 2, 8)
    pool.write(1, torch.arange(12, 16), k, -k)
    page3 = _bytes(bufs[2])[3 * pool.page_bytes:4 * pool.page_bytes]
    assert torch.equal(page3.view(torch.float32).view(4, 2, 8), k)
    assert torch.equal(pool.v_pages(1)[3], -k)


def test_kv_pool_unknown_layout():
    with pytest.raises(ValueError, match="kv_layout"):
        KVPool(2, 4, 1, 1, 8, torch.float32, layout="head_major")


def test_pages_for_budget():
    kw = dict(page_size=16, num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32, device=torch.device("cpu"))
    per_page = 2 * 30 * 16 * 3 * 64 * 4
    assert pages_for_budget(10 * per_page + 5, **kw) == 10
    assert pages_for_budget("1GiB", **kw) == (1 << 30) // per_page
    assert pages_for_budget(0.01, **kw) >= 1
    with pytest.raises(ValueError):
        pages_for_budget(100, **kw)
    assert parse_bytes("512MB") == 512 * 10**6 and parse_bytes("0.5") == 0.5 and parse_bytes("1024") == 1024


def test_freed_pages_come_back_as_ascending_runs():
    """Pages freed together are handed out again in ascending order (few, large transfer runs)."""
    from engine.kvcache.page_allocator import PageAllocator

    alloc = PageAllocator(num_pages=32, page_size=4)
    first = alloc.alloc(32)
    alloc.free(first[10:20][::-1])  # freed newest-first, as a request's release may do
    assert alloc.alloc(10) == list(range(10, 20))


@pytest.mark.parametrize("layout", ["page_major", "layer_major"])
def test_copy_pages_copies_every_layer_k_and_v_and_nothing_else(layout):
    pool = KVPool(8, 4, 3, 2, 8, torch.float32, layout=layout)
    for b in pool.buffers():
        b.copy_(torch.randn(b.shape))
    before = [b.clone() for b in pool.buffers()]
    pool.copy_pages(torch.tensor([1, 2]), torch.tensor([6, 5]))
    for layer in range(3):
        for pages in (pool.k_pages(layer), pool.v_pages(layer)):
            assert torch.equal(pages[6], pages[1]) and torch.equal(pages[5], pages[2])
    keep = [0, 1, 2, 3, 4, 7]
    for old, now in zip(before, pool.buffers()):   # only pages 5 and 6 changed
        assert torch.equal(old[keep], now[keep]) and not torch.equal(old[5], now[5])
