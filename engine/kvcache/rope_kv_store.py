"""RoPE and the K/V store of one layer in one kernel (Triton, CUDA): what the fused GPU path runs
between the q/k/v projection and attention.

Without it a layer launches three kernels there: flashinfer's RoPE on q and k (in place), then two
``index_put`` kernels that write K and V at the new tokens' slots (``KVPool.write``). The index_put
kernels move one 2-byte element per thread: at an 8k-token prefill they took 3.7 ms of the pass
against ~0.5 ms of bytes (bench/results/GPU_NOTES.md, session 8), and in a decode step each of the
three is a separate graph node of a few microseconds. Here one program rotates (or copies) a block
of heads of one token: q heads are rotated in place, k heads are rotated in place *and* written to
the pool, v heads are only written. The slot's (page, offset) is computed in the kernel, so the
per-forward ``KVPool.locate`` kernels are not needed either.

Numerics: NeoX-style rotation (HF ``rotate_half``: the pairs are ``(i, i + head_dim/2)``) in float32
from a float32 ``[positions, head_dim]`` table ``cat(cos, sin)`` (what flashinfer's
``apply_rope_with_cos_sin_cache_inplace`` takes), rounded once to the tensor's dtype: the same
arithmetic as flashinfer's kernel, within one rounding of the torch path.

Triton is imported when the kernel is first used; with ``TRITON_INTERPRET=1`` the same kernel runs
on CPU tensors (the unit tests do that). Layout after sglang's fused "rope + set KV buffer" and
vLLM's ``reshape_and_cache`` (one program per token, the slot decoded in the kernel).
"""

from __future__ import annotations

import torch

_KERNEL = None


def _heads_per_program(num_heads: int, num_kv_heads: int) -> int:
    """The largest power of two up to 8 dividing both head counts: a program never mixes q, k, v."""
    b = 8
    while num_heads % b or num_kv_heads % b:
        b //= 2
    return b


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kv_store_kernel(q, k, v, pos, slots, cs, kc, vc, sq, sk, sv, scs, s_page, s_tok,
                             H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
                             BH: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # the next kernel may launch now (it waits for this grid); this one waits for the q/k/v GEMM
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        t = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1)
        HALF: tl.constexpr = D // 2
        NQB: tl.constexpr = H // BH
        NKB: tl.constexpr = KVH // BH
        hh = tl.arange(0, BH)[:, None]
        slot = tl.load(slots + t)
        dst_off = (slot // PS) * s_page + (slot % PS) * s_tok
        if b < NQB + NKB:
            i = tl.arange(0, HALF)[None, :]
            p = tl.load(pos + t)
            cos = tl.load(cs + p * scs + i)
            sin = tl.load(cs + p * scs + HALF + i)
            if b < NQB:
                src = q + t * sq + (b * BH + hh) * D
            else:
                src = k + t * sk + ((b - NQB) * BH + hh) * D
            x1 = tl.load(src + i).to(tl.float32)
            x2 = tl.load(src + HALF + i).to(tl.float32)
            o1 = x1 * cos - x2 * sin
            o2 = x2 * cos + x1 * sin
            tl.store(src + i, o1.to(src.dtype.element_ty, fp_downcast_rounding="rtne"))
            tl.store(src + HALF + i, o2.to(src.dtype.element_ty, fp_downcast_rounding="rtne"))
            if b >= NQB:
                dst = kc + dst_off + ((b - NQB) * BH + hh) * D
                tl.store(dst + i, o1.to(kc.dtype.element_ty, fp_downcast_rounding="rtne"))
                tl.store(dst + HALF + i, o2.to(kc.dtype.element_ty, fp_downcast_rounding="rtne"))
        else:
            d = tl.arange(0, D)[None, :]
            h = (b - NQB - NKB) * BH + hh
            x = tl.load(v + t * sv + h * D + d)
            tl.store(vc + dst_off + h * D + d, x.to(vc.dtype.element_ty))

    return rope_kv_store_kernel


def rope_kv_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor, slots: torch.Tensor, k_pages: torch.Tensor,
                  v_pages: torch.Tensor, num_warps: int = 4, pdl: bool = False) -> None:
    """Rotate q and k in place (NeoX RoPE) and store the rotated k and v at ``slots``.

    q: [T, H * head_dim], k and v: [T, KVH * head_dim], each with unit stride along its last dim
    (row-strided views of one fused q/k/v row are fine), one dtype; positions: int64 [T];
    cos_sin_cache: float32 [max_positions, head_dim], ``cat(cos, sin)`` per position; slots: int64
    [T], the new tokens' pool slots (``out_cache_loc``); k_pages, v_pages: one layer's pool views
    ``[num_pages, page_size, KVH, head_dim]`` (``KVPool.k_pages``/``v_pages``; page stride free, the
    rest contiguous), one pool dtype. ``head_dim`` is ``k_pages.shape[-1]`` (even, a power of two).
    ``num_warps``: Triton warps per program (bench.gpu prefill_parts times the choices).
    ``pdl``: launch with programmatic dependent launch (CUDA, sm90+): the kernel waits for the one
    before it before reading anything and lets the next one launch at once (the decode graphs' split-KV
    attention, :mod:`engine.attention.split_kv_decode`, which waits for this one).

    Raises ValueError on mismatched shapes, dtypes, devices or strides, before anything is written.
    Slots are not range-checked (that would need a device sync inside a CUDA graph): they are
    ``out_cache_loc``, which the allocator hands out inside the pool.
    """
    global _KERNEL
    T = q.shape[0]
    P, ps, kvh, d = k_pages.shape
    if q.dim() != 2 or k.dim() != 2 or v.dim() != 2 or k.shape != (T, kvh * d) or v.shape != k.shape:
        raise ValueError(f"rope_kv_store: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         f"do not fit {kvh} kv heads of {d}")
    if q.shape[1] % d or d % 2 or d & (d - 1):
        raise ValueError(f"rope_kv_store: q width {q.shape[1]} is not a whole number of heads of {d} "
                         "(head_dim must be an even power of two)")
    h = q.shape[1] // d
    if v_pages.shape != k_pages.shape or v_pages.stride() != k_pages.stride():
        raise ValueError("rope_kv_store: k_pages and v_pages differ in shape or strides")
    if k_pages.stride()[1:] != (kvh * d, d, 1):
        raise ValueError(f"rope_kv_store: pool views must be contiguous within a page, strides {k_pages.stride()}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("rope_kv_store: q, k, v need unit stride along their last dim")
    if not (q.dtype == k.dtype == v.dtype) or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"rope_kv_store: dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}, pool {k_pages.dtype}")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.shape[1] != d or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"rope_kv_store: cos_sin_cache must be float32 [positions, {d}]")
    if positions.shape != (T,) or slots.shape != (T,):
        raise ValueError(f"rope_kv_store: positions {tuple(positions.shape)}, slots {tuple(slots.shape)} "
                         f"must be [{T}]")
    devs = {t.device for t in (q, k, v, positions, cos_sin_cache, slots, k_pages, v_pages)}
    if len(devs) != 1:
        raise ValueError(f"rope_kv_store: tensors on several devices {sorted(map(str, devs))}")
    if T == 0:
        return
    if _KERNEL is None:
        _KERNEL = _build()
    bh = _heads_per_program(h, kvh)
    grid = (T, (h + 2 * kvh) // bh)
    _KERNEL[grid](q, k, v, positions, slots, cos_sin_cache, k_pages, v_pages, q.stride(0), k.stride(0),
                  v.stride(0), cos_sin_cache.stride(0), k_pages.stride(0), k_pages.stride(1),
                  H=h, KVH=kvh, D=d, PS=ps, BH=bh, PDL=pdl, num_warps=num_warps,
                  **({"launch_pdl": True} if pdl else {}))
