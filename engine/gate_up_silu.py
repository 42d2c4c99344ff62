"""The MLP's gate/up projection and SiLU·mul in one GEMM kernel (Triton, CUDA; measured, not wired in).

The fused GPU path runs ``gate_up = x @ W_gu.T`` (one cuBLAS GEMM, ``W_gu = [W_gate; W_up]``,
``[2I, K]``) and then flashinfer's ``silu_and_mul``, which reads the ``[T, 2I]`` bf16 result back
and writes ``[T, I]``. At an 8k-token prefill that second kernel moves ~0.7 GB a layer (6 ms of the
~212 ms pass on the H200). Here each program computes a ``[BM, BN]`` tile of the output with two
fp32 accumulators over the same ``x`` tile, the gate rows ``n`` and the up rows ``I + n`` of the
weight, and stores ``silu(gate) * up`` once: the ``[T, 2I]`` intermediate never exists.

Numerics: SiLU·mul is applied to the fp32 accumulators, not to bf16-rounded gate/up values, so the
result is within one bf16 rounding of the two-kernel path (closer to the fp32 reference).

Two variants of the same loop: ``"ptr"`` (pointer loads, software pipelined by ``num_stages``) and
``"tma"`` (Hopper tensor-memory-accelerator loads through host-built tensor descriptors). Which
tile wins, and whether either beats cuBLAS + ``silu_and_mul``, is measured by
``python -m bench.gpu gate_up_micro`` (bench/results/GPU_NOTES.md, session 16). Triton is imported
at first use; ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors (the unit tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_KERNELS: dict[str, object] = {}


@dataclass(frozen=True)
class Tile:
    """A launch configuration: output tile ``bm x bn``, K step ``bk``, ``group_m`` row tiles per
    weight-column sweep (L2 reuse of the weight), ``warps`` and pipeline ``stages``."""

    bm: int = 128
    bn: int = 128
    bk: int = 64
    group_m: int = 8
    warps: int = 8
    stages: int = 3


def _build(variant: str):
    import triton
    import triton.language as tl

    @triton.jit
    def ptr_kernel(x_ptr, w_ptr, o_ptr, M, N, K, sx, sw, so,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)  # grouped order: GROUP_M row tiles sweep the weight columns together
        n_m, n_n = (M + BM - 1) // BM, (N + BN - 1) // BN
        first_m = (pid // (GROUP_M * n_n)) * GROUP_M
        size_m = tl.minimum(n_m - first_m, GROUP_M)
        pm = first_m + (pid % (GROUP_M * n_n)) % size_m
        pn = (pid % (GROUP_M * n_n)) // size_m
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        xp = x_ptr + rm[:, None] * sx + rk[None, :]
        gp = w_ptr + rn[None, :] * sw + rk[:, None]  # [BK, BN]: W_gate^T
        up = gp + N * sw  # the up rows start I = N rows further
        m_ok, n_ok = rm[:, None] < M, rn[None, :] < N
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(0, K // BK):  # K % BK == 0 (checked by the caller)
            a = tl.load(xp, mask=m_ok, other=0.0)
            acc_g = tl.dot(a, tl.load(gp, mask=n_ok, other=0.0), acc_g)
            acc_u = tl.dot(a, tl.load(up, mask=n_ok, other=0.0), acc_u)
            xp += BK
            gp += BK
            up += BK
        out = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(o_ptr + rm[:, None] * so + rn[None, :], out.to(o_ptr.dtype.element_ty), mask=m_ok & n_ok)

    @triton.jit
    def tma_kernel(x_desc, w_desc, o_desc, M, N, K,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)  # grouped order: GROUP_M row tiles sweep the weight columns together
        n_m, n_n = (M + BM - 1) // BM, (N + BN - 1) // BN
        first_m = (pid // (GROUP_M * n_n)) * GROUP_M
        size_m = tl.minimum(n_m - first_m, GROUP_M)
        pm = first_m + (pid % (GROUP_M * n_n)) % size_m
        pn = (pid % (GROUP_M * n_n)) // size_m
        om, on = pm * BM, pn * BN
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K // BK):
            a = x_desc.load([om, k * BK])
            acc_g = tl.dot(a, w_desc.load([on, k * BK]).T, acc_g)
            acc_u = tl.dot(a, w_desc.load([N + on, k * BK]).T, acc_u)
        out = acc_g * tl.sigmoid(acc_g) * acc_u
        o_desc.store([om, on], out.to(o_desc.dtype))

    return ptr_kernel if variant == "ptr" else tma_kernel


def gate_up_silu(x: torch.Tensor, w_gate_up: torch.Tensor, tile: Tile = Tile(), variant: str = "ptr") -> torch.Tensor:
    """``silu(x @ W_gate.T) * (x @ W_up.T)`` for x [T, K] and ``w_gate_up = [W_gate; W_up]`` [2I, K]
    (same dtype, bf16/fp16 on CUDA or, interpreted, CPU), both with unit last stride -> [T, I] in
    x's dtype. ``variant``: "ptr" | "tma" (see the module docstring).

    Raises ValueError when the shapes disagree, the weight's rows are odd, K is not a multiple of
    ``tile.bk``, or (tma) I is not a multiple of ``tile.bn``."""
    T, K = x.shape
    two_i, K2 = w_gate_up.shape
    if K != K2 or two_i % 2 or K % tile.bk or x.stride(-1) != 1 or w_gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up_silu: x {tuple(x.shape)} and weight {tuple(w_gate_up.shape)} do not fit "
                         f"(K a multiple of {tile.bk}, 2I even, unit last strides)")
    if variant not in ("ptr", "tma"):
        raise ValueError(f"gate_up_silu: variant must be 'ptr' or 'tma', got {variant!r}")
    N = two_i // 2
    if variant == "tma" and N % tile.bn:
        raise ValueError(f"gate_up_silu: tma needs I ({N}) a multiple of bn ({tile.bn})")
    kern = _KERNELS.get(variant) or _KERNELS.setdefault(variant, _build(variant))
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    grid = (-(-T // tile.bm) * -(-N // tile.bn),)
    meta = dict(BM=tile.bm, BN=tile.bn, BK=tile.bk, GROUP_M=tile.group_m, num_warps=tile.warps,
                num_stages=tile.stages)
    if variant == "ptr":
        kern[grid](x, w_gate_up, out, T, N, K, x.stride(0), w_gate_up.stride(0), out.stride(0), **meta)
    else:
        from triton.tools.tensor_descriptor import TensorDescriptor

        kern[grid](TensorDescriptor.from_tensor(x, [tile.bm, tile.bk]),
                   TensorDescriptor.from_tensor(w_gate_up, [tile.bn, tile.bk]),
                   TensorDescriptor.from_tensor(out, [tile.bm, tile.bn]), T, N, K, **meta)
    return out
