"""The fused RoPE + K/V store kernel (engine/kvcache/rope_kv_store.py) against the ops it replaces:
torch RoPE (HF ``rotate_half``) on q and k, ``KVPool.write`` of the rotated k and of v.

On CPU the Triton kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``), which evaluates the
same kernel body with numpy float32 (no fused multiply-add): float32 results, and every slot written or
left alone, are compared bit for bit. The interpreter's float32 -> bfloat16 cast does not round to
nearest as the GPU's does, so bf16 values are compared within one bf16 ulp there; on a GPU (marked
``gpu``) the kernel is compared against flashinfer's RoPE and ``KVPool.write``.
"""

from __future__ import annotations

import pytest
import torch

from engine.kvcache import rope_kv_store as rks
from engine.kvcache.kv_pool import KVPool

pytest.importorskip("triton")


@pytest.fixture
def interpreted(monkeypatch):
    """The kernel built for Triton's CPU interpreter, for this test only."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(rks, "_KERNEL", None)


def rope_table(positions: int, d: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    f = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return torch.cat((f.cos(), f.sin()), -1).contiguous()


def torch_rope(x: torch.Tensor, pos: torch.Tensor, cs: torch.Tensor, d: int) -> torch.Tensor:
    """HF's rotation in float32, rounded once: x [T, heads * d]."""
    T = x.shape[0]
    xf = x.float().view(T, -1, d)
    cos, sin = cs[pos, : d // 2][:, None, :], cs[pos, d // 2:][:, None, :]
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(x.dtype).view(T, -1)


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-equal in float32; within one ulp in bfloat16 (the interpreter's cast, module docstring)."""
    if got.dtype == torch.float32:
        return torch.equal(got, want)
    return bool(((got.float() - want.float()).abs() <= want.float().abs() * 2**-7).all())


def case(dtype, layout, H=4, KVH=2, d=16, T=7, ps=4, pages=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (H + 2 * KVH) * d, generator=g).to(dtype)  # one fused row: q, k, v are views
    pool = KVPool(pages, ps, 3, KVH, d, dtype, "cpu", layout=layout)
    for b in pool.buffers():
        b.copy_(torch.randn(b.shape, generator=g).to(dtype))
    slots = torch.randperm(pages * ps, generator=g)[:T]
    pos = torch.randint(0, 50, (T,), generator=g)
    return qkv, pool, slots, pos, rope_table(64, d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["page_major", "layer_major"])
def test_equals_torch_rope_and_pool_write(interpreted, dtype, layout):
    H, KVH, d = 4, 2, 16
    qkv, pool, slots, pos, cs = case(dtype, layout, H, KVH, d)
    q, k, v = qkv.split([H * d, KVH * d, KVH * d], -1)
    want_q, want_k = torch_rope(q, pos, cs, d), torch_rope(k, pos, cs, d)
    ref = KVPool(pool.num_pages, pool.page_size, 3, KVH, d, dtype, "cpu", layout=layout)
    for a, b in zip(ref.buffers(), pool.buffers()):
        a.copy_(b)
    ref.write(1, slots, want_k.view(-1, KVH, d), v.reshape(-1, KVH, d))
    v_before = v.clone()

    rks.rope_kv_store(q, k, v, pos, cs, slots, pool.k_pages(1), pool.v_pages(1))

    assert same(q, want_q) and same(k, want_k) and torch.equal(v, v_before)
    page, off = pool.locate(slots)
    written = torch.zeros(pool.num_pages, pool.page_size, dtype=torch.bool)
    written[page, off] = True
    for layer in range(3):  # layer 1's new-token slots hold rotated k and v; nothing else changed
        for got, want in ((pool.k_pages(layer), ref.k_pages(layer)), (pool.v_pages(layer), ref.v_pages(layer))):
            if layer == 1:
                assert same(got[written], want[written])
                assert torch.equal(got[~written], want[~written])
            else:
                assert torch.equal(got, want)


def test_head_blocks_never_mix_q_k_v(interpreted):
    # 6 q heads and 2 kv heads: programs of 2 heads; 12 q heads / 4 kv heads: programs of 4
    assert rks._heads_per_program(6, 2) == 2 and rks._heads_per_program(12, 4) == 4
    assert rks._heads_per_program(32, 8) == 8 and rks._heads_per_program(7, 1) == 1
    H, KVH, d = 6, 2, 8
    qkv, pool, slots, pos, cs = case(torch.bfloat16, "page_major", H, KVH, d, T=5)
    q, k, v = qkv.split([H * d, KVH * d, KVH * d], -1)
    want_q, want_k = torch_rope(q, pos, cs, d), torch_rope(k, pos, cs, d)
    rks.rope_kv_store(q, k, v, pos, cs, slots, pool.k_pages(0), pool.v_pages(0))
    assert same(q, want_q) and same(k, want_k)
    page, off = pool.locate(slots)
    assert same(pool.k_pages(0)[page, off], want_k.view(-1, KVH, d))
    assert torch.equal(pool.v_pages(0)[page, off], v.reshape(-1, KVH, d))


@pytest.mark.parametrize("bad", ["k_heads", "q_width", "slots_len", "cache_dtype", "strided_last", "pool_dtype_mix"])
def test_bad_inputs_raise_before_writing(bad):
    H, KVH, d = 4, 2, 16
    qkv, pool, slots, pos, cs = case(torch.bfloat16, "page_major", H, KVH, d)
    q, k, v = qkv.split([H * d, KVH * d, KVH * d], -1)
    kp, vp = pool.k_pages(0), pool.v_pages(0)
    if bad == "k_heads":
        k = k[:, :d]
    elif bad == "q_width":
        q = q[:, : 3 * d + 2]
    elif bad == "slots_len":
        slots = slots[:-1]
    elif bad == "cache_dtype":
        cs = cs.to(torch.bfloat16)
    elif bad == "strided_last":
        v = qkv[:, ::2][:, : KVH * d]
    elif bad == "pool_dtype_mix":
        vp = vp.float()
    before = [b.clone() for b in pool.buffers()] + [qkv.clone()]
    with pytest.raises(ValueError, match="rope_kv_store"):
        rks.rope_kv_store(q, k, v, pos, cs, slots, kp, vp)
    assert all(torch.equal(a, b) for a, b in zip(before, list(pool.buffers()) + [qkv]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_matches_flashinfer_rope_and_pool_write():
    flashinfer = pytest.importorskip("flashinfer")
    H, KVH, d, T, ps = 32, 8, 128, 300, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(T, (H + 2 * KVH) * d, device="cuda", generator=g).to(torch.bfloat16)
    pool = KVPool(64, ps, 2, KVH, d, torch.bfloat16, "cuda")
    slots = torch.randperm(64 * ps, device="cuda", generator=g)[:T]
    pos = torch.randint(0, 4000, (T,), device="cuda", generator=g)
    cs = rope_table(4096, d).cuda()
    ref_qkv = qkv.clone()
    rq, rk, rv = ref_qkv.split([H * d, KVH * d, KVH * d], -1)
    flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(pos, rq, rk, d, cs, is_neox=True)
    ref = KVPool(64, ps, 2, KVH, d, torch.bfloat16, "cuda")
    ref.write(1, slots, rk.reshape(T, KVH, d), rv.reshape(T, KVH, d))
    q, k, v = qkv.split([H * d, KVH * d, KVH * d], -1)
    rks.rope_kv_store(q, k, v, pos, cs, slots, pool.k_pages(1), pool.v_pages(1))
    torch.cuda.synchronize()
    # float32 arithmetic rounded once on both sides; FMA contraction may move a value by one bf16 ulp
    torch.testing.assert_close(qkv, ref_qkv, rtol=1e-2, atol=1e-2)
    page, off = pool.locate(slots)
    torch.testing.assert_close(pool.k_pages(1)[page, off], ref.k_pages(1)[page, off], rtol=1e-2, atol=1e-2)
    assert torch.equal(pool.v_pages(1)[page, off], ref.v_pages(1)[page, off])
    assert (pool.k_pages(0) == 0).all() and (pool.v_pages(0) == 0).all()
