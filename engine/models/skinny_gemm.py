"""Decode-size GEMMs on CUDA (Triton): ``y = act(x) @ W.T`` for a few rows, split over N only.

At decode sizes (M = 1..16 rows) a projection is a weight read. cuBLAS reads the 8B model's q/k/v
and o projections at ~3.3 and ~2.7 TB/s against ~4.2 for gate/up, it splits K for o and down and
adds a reduce kernel after each, and the MLP runs SiLU·mul as a kernel of its own between gate/up
and down (bench.gpu small_gemm and graph_profile, bench/results/GPU_NOTES.md session 11). Here one
program owns ``BN`` output columns and reads the whole K of their weight rows in ``BK``-wide steps:
nothing to reduce afterwards, and for down_proj the input's ``silu(gate) * up`` is computed as it is
loaded (``glu=True``), so an MLP is two kernels instead of four.

Numerics: products summed in float32 (tensor-core ``dot`` with the rows padded to 16), rounded once
to the output dtype, as cuBLAS does, though in another order: outputs may differ from ``F.linear``
by one rounding. The GLU prologue rounds ``silu(g) * u`` to the weight dtype before the product,
as the separate SiLU·mul kernel's output is.

Triton is imported when the kernel is first used; with ``TRITON_INTERPRET=1`` the same kernel runs
on CPU tensors (the unit tests do that). The shape is the split-N "GEMV" of decode engines (e.g.
gpt-fast's and TensorRT-LLM's weight-only paths): no split K, so no second kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_ROWS = 4  # CUDA-core products: past a few rows the weight tile is reused enough for tensor cores
_KERNEL = None


@dataclass(frozen=True)
class SkinnyConfig:
    """Tile of one program: ``bn`` output columns, ``bk`` of K per step; Triton's warps/stages."""

    bn: int = 32
    bk: int = 256
    num_warps: int = 4
    num_stages: int = 4


DEFAULT = SkinnyConfig()


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def skinny_gemm_kernel(x, w, y, M, N, K, sxm, swn, sym,
                           GLU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rm = tl.arange(0, BM)
        rk = tl.arange(0, BK)
        nmask = rn < N
        mmask = rm < M
        wp = w + rn[:, None].to(tl.int64) * swn + rk[None, :]
        xp = x + rm[:, None].to(tl.int64) * sxm + rk[None, :]
        acc = tl.full((BM, BN), 0.0, tl.float32)  # not tl.zeros: a jit function the interpreter cannot call here
        for _ in range(0, K, BK):
            wt = tl.load(wp, mask=nmask[:, None], other=0.0).to(tl.float32)  # [BN, BK]
            if GLU:
                g = tl.load(xp, mask=mmask[:, None], other=0.0).to(tl.float32)
                u = tl.load(xp + K, mask=mmask[:, None], other=0.0).to(tl.float32)
                a = (g / (1.0 + tl.exp(-g)) * u).to(w.dtype.element_ty).to(tl.float32)
            else:
                a = tl.load(xp, mask=mmask[:, None], other=0.0).to(tl.float32)  # [BM, BK]
            acc += tl.sum(a[:, None, :] * wt[None, :, :], axis=2)
            wp += BK
            xp += BK
        tl.store(y + rm[:, None] * sym + rn[None, :], acc.to(y.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])

    return skinny_gemm_kernel


def supports(x: torch.Tensor, weight: torch.Tensor, glu: bool = False, cfg: SkinnyConfig = DEFAULT) -> bool:
    """True when :func:`skinny_gemm` takes these operands (else the caller runs cuBLAS): at most
    ``MAX_ROWS`` rows, a 2-D weight with contiguous rows, K a multiple of ``cfg.bk``, one dtype."""
    K = weight.shape[-1]
    return (x.dim() == 2 and weight.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and x.shape[1] == (2 * K if glu else K) and x.stride(1) == 1 and weight.stride(1) == 1
            and K % cfg.bk == 0 and x.dtype == weight.dtype and x.device == weight.device)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, glu: bool = False,
                cfg: SkinnyConfig = DEFAULT, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` (``glu=False``) or ``(silu(x[:, :K]) * x[:, K:]) @ weight.T`` (``glu=True``).

    x: [M, K] (or [M, 2K] with ``glu``), M <= ``MAX_ROWS``, unit stride along K; weight: [N, K]
    with contiguous rows (an ``nn.Linear`` weight or a row slice of one); same dtype (bf16/fp16 on
    CUDA; any float dtype under ``TRITON_INTERPRET=1``). Returns [M, N] of that dtype (or fills
    ``out``). Raises ValueError naming skinny_gemm when :func:`supports` is False.
    """
    global _KERNEL
    if not supports(x, weight, glu, cfg):
        raise ValueError(f"skinny_gemm: unsupported operands x {tuple(x.shape)} {x.dtype} stride "
                         f"{x.stride()}, weight {tuple(weight.shape)} {weight.dtype} stride {weight.stride()}, "
                         f"glu={glu}, bk={cfg.bk} (at most {MAX_ROWS} rows, K a multiple of bk)")
    if _KERNEL is None:
        _KERNEL = _build()
    M, (N, K) = x.shape[0], weight.shape
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    grid = ((N + cfg.bn - 1) // cfg.bn,)
    _KERNEL[grid](x, weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
                  GLU=glu, BM=1 if M == 1 else (2 if M == 2 else 4), BN=cfg.bn, BK=cfg.bk,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
