"""The ``cpu_paged`` backend's C++ decode kernel against the reference ``torch`` backend's masked GQA
SDPA on random pools: ragged rows (1 token, a page minus one, a page, a page plus one, > 1000
tokens) in one batch on scattered pages, a row sharing its prefix pages with another (the radix
cache), GQA groups 1/3/4, kv heads 1..3, both pool layouts, float32 (1e-5) and bfloat16 pools,
rows split across threads (flash-decoding merge), head_dim 16/64/80/128, page sizes 1-48. ``auto`` picks it on CPU, and says why when not.

The kernel must be built (``make kernels``; ``make test`` does it first): a missing build fails here
with the build command rather than compiling inside a test's timeout.
"""

from __future__ import annotations

import logging

import pytest
import torch

from engine import attention
from engine.attention import create_backend, resolve_backend_name
from engine.cpu_kernels import PAGED_DECODE as cpu_kernel
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.kvcache.kv_pool import KVPool
from engine.kvcache.req_to_token_pool import ReqToTokenPool

PS, LAYERS, D = 16, 2, 64
LENS = [1, PS - 1, PS, PS + 1, 1203, 37]


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    mod, why = cpu_kernel.load()
    assert mod is not None, why


def _setup(layout, kvh, group, lens, dtype=torch.float32, share_prefix=False, seed=0, d=D, ps=PS):
    g = torch.Generator().manual_seed(seed)
    need = [-(-(n + 1) // ps) for n in lens]
    pages = sum(need) + 5
    pool = KVPool(pages, ps, LAYERS, kvh, d, dtype, "cpu", layout=layout)
    for buf in pool.buffers():
        buf.copy_(torch.randn(buf.shape, generator=g))
    r2t = ReqToTokenPool(len(lens) + 1, 2048)
    order = torch.randperm(pages, generator=g).tolist()  # a row's pages are scattered in the pool
    rows, first_pages = [], None
    for i, n in enumerate(lens):
        row = r2t.alloc()
        own = [order.pop() for _ in range(need[i])]
        if share_prefix and first_pages is not None:  # the radix-cache case: same prefix pages
            k = min(len(first_pages) - 1, len(own) - 1)
            own[:k] = first_pages[:k]
        if first_pages is None:
            first_pages = own
        slots = (torch.tensor(own)[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)[:n + 1]
        r2t.write(row, 0, slots)
        r2t.req_to_token[row, n + 1:] = order[0] * ps  # stale slots past the row's end
        rows.append(row)
    kw = dict(kv_pool=pool, req_to_token_pool=r2t, num_heads=kvh * group, num_kv_heads=kvh, head_dim=d)
    return pool, r2t, rows, kw, g


def _decode_both(layout, kvh, group, lens, dtype=torch.float32, share_prefix=False, d=D, ps=PS):
    pool, r2t, rows, kw, g = _setup(layout, kvh, group, lens, dtype, share_prefix, d=d, ps=ps)
    batch = ForwardBatch.decode(rows, lens, [0] * len(lens), r2t.req_to_token)
    H, B = kvh * group, len(lens)
    q = torch.randn(B, H, d, generator=g).to(dtype)
    k, v = torch.randn(B, kvh, d, generator=g).to(dtype), torch.randn(B, kvh, d, generator=g).to(dtype)
    outs = {}
    for name in ("torch", "cpu_paged"):
        backend = create_backend(name, **kw)
        backend.init_forward(batch)
        outs[name] = [backend.forward(q, k, v, layer, batch) for layer in range(LAYERS)]
    return outs, pool, batch, k


@pytest.mark.parametrize("layout", ["page_major", "layer_major"])
@pytest.mark.parametrize("kvh,group", [(1, 1), (2, 3), (3, 3), (3, 4), (1, 4)])
def test_kernel_matches_reference_fp32(layout, kvh, group):
    outs, pool, batch, k = _decode_both(layout, kvh, group, LENS)
    for want, got in zip(outs["torch"], outs["cpu_paged"]):
        assert got.shape == want.shape == (len(LENS), kvh * group * D) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool.read(1, batch.out_cache_loc)[0], k)  # the new K/V were stored


@pytest.mark.parametrize("d", [16, 80, 128])
def test_kernel_other_head_dims(d):
    """128 has its own compiled variant (as 64 does); 16 and 80 take the runtime-D loops."""
    outs, *_ = _decode_both("layer_major", 2, 3, LENS, d=d)
    for want, got in zip(outs["torch"], outs["cpu_paged"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ps", [1, 4, 32, 48])
def test_kernel_other_page_sizes(ps):
    """Pages of fewer and of more than the 16 tokens one QK block sums (48: three blocks a page)."""
    lens = [1, ps - 1 or 1, ps, ps + 1, 3 * ps + 5, 700]
    outs, *_ = _decode_both("page_major", 3, 3, lens, ps=ps)
    for want, got in zip(outs["torch"], outs["cpu_paged"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_shared_prefix_pages():
    outs, *_ = _decode_both("page_major", 3, 3, [300, 290, 17], share_prefix=True)
    for want, got in zip(outs["torch"], outs["cpu_paged"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_bf16_pool():
    outs, *_ = _decode_both("page_major", 3, 3, LENS, dtype=torch.bfloat16)
    for want, got in zip(outs["torch"], outs["cpu_paged"]):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("threads", [1, 2, 7])
def test_rows_split_across_threads_merge(threads):
    """B * kv_heads below the thread count: each row is cut into splits merged afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pool, r2t, rows, kw, g = _setup("page_major", 1, 4, [1203])
        batch = ForwardBatch.decode(rows, [1203], [0], r2t.req_to_token)
        q = torch.randn(1, 4, D, generator=g)
        k, v = torch.randn(1, 1, D, generator=g), torch.randn(1, 1, D, generator=g)
        ref, new = create_backend("torch", **kw), create_backend("cpu_paged", **kw)
        ref.init_forward(batch)
        new.init_forward(batch)
        assert new._splits == threads
        want, got = ref.forward(q, k, v, 0, batch), new.forward(q, k, v, 0, batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for splits in (2, 5, 76, 200):  # more splits than pages: the empty ones weigh nothing
            out = torch.empty(1, 4, D)
            new._kernel.paged_decode(q, pool.k_pages(0), pool.v_pages(0), new._table, new._lens,
                                     new.scale, out, splits)
            torch.testing.assert_close(out.reshape(1, -1), want, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(old)


def test_extend_stays_on_the_reference_path():
    pool, r2t, rows, kw, g = _setup("page_major", 3, 3, [100])
    row, n, pre = rows[0], 100, 2 * PS
    batch = ForwardBatch.build(ForwardMode.EXTEND, [row], [pre], [[0] * (n + 1 - pre)],
                               r2t.req_to_token[row, pre:n + 1].clone())
    T = n + 1 - pre
    q, k, v = (torch.randn(T, 9, D, generator=g), torch.randn(T, 3, D, generator=g),
               torch.randn(T, 3, D, generator=g))
    outs = []
    for name in ("torch_paged", "cpu_paged"):
        backend = create_backend(name, **kw)
        backend.init_forward(batch)
        outs.append(backend.forward(q, k, v, 0, batch))
    assert torch.equal(outs[0], outs[1])


def test_kernel_rejects_bad_inputs():
    pool, r2t, rows, kw, g = _setup("page_major", 3, 3, [20])
    mod = cpu_kernel.load()[0]
    q, out = torch.randn(1, 9, D), torch.empty(1, 9, D)
    table, lens = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="page_table must be contiguous int32"):
        mod.paged_decode(q, pool.k_pages(0), pool.v_pages(0), table.long(), lens, 0.1, out, 1)
    with pytest.raises(RuntimeError, match="not a multiple of kv heads"):
        mod.paged_decode(torch.randn(1, 8, D), pool.k_pages(0), pool.v_pages(0), table, lens, 0.1,
                         torch.empty(1, 8, D), 1)


def test_auto_is_cpu_paged_on_cpu_when_built():
    assert resolve_backend_name("auto", torch.device("cpu"), torch.float32) == "cpu_paged"
    assert resolve_backend_name("auto", torch.device("cpu"), torch.bfloat16) == "cpu_paged"
    assert resolve_backend_name("auto", torch.device("cpu"), torch.float16) == "torch_paged"


def test_unbuilt_kernel_auto_falls_back_with_reason_explicit_raises(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernel, "_loaded", (None, "not built (test)"))
    monkeypatch.setattr(attention, "_said_why", set())
    with caplog.at_level(logging.INFO, logger="halfmoon.engine.attention"):
        assert resolve_backend_name("auto", torch.device("cpu"), torch.float32) == "torch_paged"
        assert resolve_backend_name("auto", torch.device("cpu"), torch.float32) == "torch_paged"
    said = [r.getMessage() for r in caplog.records if "not built (test)" in r.getMessage()]
    assert len(said) == 1 and "torch_paged, not cpu_paged" in said[0]
    pool, r2t, rows, kw, g = _setup("page_major", 1, 1, [3])
    with pytest.raises(ValueError, match="attention_backend: cpu_paged: not built"):
        create_backend("cpu_paged", **kw)


def test_load_never_builds_and_names_the_build_command(monkeypatch, tmp_path):
    """A home without this source's build: no compiler runs, the reason names the directory and
    `make kernels`; the key follows the source, so an edited kernel is never a stale import."""
    monkeypatch.setenv("HALFMOON_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_kernel, "_loaded", None)
    mod, why = cpu_kernel.load()
    assert mod is None and str(tmp_path / "kernels") in why and "make kernels" in why
    assert not (tmp_path / "kernels").exists()
    key = cpu_kernel.build_key()
    src = tmp_path / "paged_decode.cpp"
    src.write_bytes(cpu_kernel.source.read_bytes() + b"// edited\n")
    monkeypatch.setattr(cpu_kernel, "source", src)
    assert cpu_kernel.build_key() != key


@pytest.mark.parametrize("layout", ["page_major", "layer_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_and_decode_stores_what_kv_pool_write_stores_and_attends_like_paged_decode(layout, dtype):
    """The backend's decode call: k / v stored at the step's slots with the same bytes as
    ``KVPool.write`` (q, k, v strided views of one fused q/k/v row, as the model passes them), then
    the same output as ``paged_decode`` on a float32 copy of q, cast back to q's dtype."""
    lens = [1, PS + 1, 300]
    pool, r2t, rows, kw, g = _setup(layout, 3, 3, lens, dtype)
    ref_pool, *_ = _setup(layout, 3, 3, lens, dtype)
    backend = create_backend("cpu_paged", **kw)
    batch = ForwardBatch.decode(rows, lens, [0] * len(lens), r2t.req_to_token)
    backend.init_forward(batch)
    B, H, KVH = len(lens), 9, 3
    qkv = torch.randn(B, (H + 2 * KVH) * D, generator=g).to(dtype)
    q = qkv[:, :H * D].view(B, H, D)
    k, v = qkv[:, H * D:(H + KVH) * D].view(B, KVH, D), qkv[:, (H + KVH) * D:].view(B, KVH, D)
    mod = cpu_kernel.load()[0]
    got = mod.store_and_decode(q, k, v, pool.k_pages(1), pool.v_pages(1), batch.out_cache_loc, backend._table,
                               backend._lens, backend.scale, backend._splits)
    ref_pool.write(1, batch.out_cache_loc, k, v)
    assert all(torch.equal(a, b) for a, b in zip(pool.buffers(), ref_pool.buffers()))
    want = torch.empty(B, H, D)
    mod.paged_decode(q.float().contiguous(), ref_pool.k_pages(1), ref_pool.v_pages(1), backend._table,
                     backend._lens, backend.scale, want, backend._splits)
    assert got.dtype == dtype and torch.equal(got, want.to(dtype).view(B, H * D))


def test_store_and_decode_refuses_a_slot_outside_the_pool_before_writing():
    pool, r2t, rows, kw, g = _setup("page_major", 3, 3, [20])
    mod = cpu_kernel.load()[0]
    before = [b.clone() for b in pool.buffers()]
    q, k = torch.randn(2, 9, D), torch.randn(2, 3, D)
    table, lens = torch.zeros(2, 2, dtype=torch.int32), torch.tensor([20, 20], dtype=torch.int32)
    bad = torch.tensor([5, pool.num_slots], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="outside the pool"):
        mod.store_and_decode(q, k, k, pool.k_pages(0), pool.v_pages(0), bad, table, lens, 0.1, 1)
    with pytest.raises(RuntimeError, match="outside the pool"):
        mod.store_and_decode(q, k, k, pool.k_pages(0), pool.v_pages(0), torch.tensor([-1, 0]), table, lens, 0.1, 1)
    assert all(torch.equal(a, b) for a, b in zip(pool.buffers(), before))
