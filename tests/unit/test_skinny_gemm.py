"""The split-N decode GEMM kernel (engine/models/skinny_gemm.py) against ``F.linear`` and against
SiLU·mul followed by ``F.linear`` (its GLU prologue), and the fused GPU path's dispatch to it.

On CPU the Triton kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``) on float32 tensors;
the kernel sums in another order than torch, so results are compared within float32 rounding of the
sum. On a GPU (marked ``gpu``) bf16 results are compared with cuBLAS within one bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.fused_ops import skinny_setting
from engine.models import skinny_gemm as sk

triton = pytest.importorskip("triton")

SMALL = sk.SkinnyConfig(bn=16, bk=32, num_warps=4, num_stages=2)


@pytest.fixture
def interpreted(monkeypatch):
    """The kernel built for Triton's CPU interpreter, for this test only. The interpreter needs
    TRITON_INTERPRET=1 from before triton's import (tests/conftest.py sets it where there is no GPU)."""
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.standard.sum, InterpretedFunction):
        pytest.skip("triton was imported without TRITON_INTERPRET=1 (a GPU machine)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(sk, "_KERNEL", None)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    g, u = x.chunk(2, dim=-1)
    return F.silu(g) * u


@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("N", [48, 40])  # 40: the last program's columns are partly past N
def test_matches_linear(interpreted, M, N):
    g = torch.Generator().manual_seed(M * 100 + N)
    x, w = torch.randn(M, 96, generator=g), torch.randn(N, 96, generator=g)
    got = sk.skinny_gemm(x, w, cfg=SMALL)
    assert got.shape == (M, N) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("M", [1, 3])
def test_glu_prologue_matches_silu_mul_then_linear(interpreted, M):
    g = torch.Generator().manual_seed(M)
    x, w = torch.randn(M, 2 * 64, generator=g), torch.randn(24, 64, generator=g)
    torch.testing.assert_close(sk.skinny_gemm(x, w, glu=True, cfg=SMALL), F.linear(silu_mul(x), w),
                               rtol=1e-5, atol=1e-4)


def test_strided_rows_and_out(interpreted):
    """x a row-strided view (a slice of a wider activation), the weight a row slice of a fused one."""
    g = torch.Generator().manual_seed(7)
    big, fused = torch.randn(4, 160, generator=g), torch.randn(64, 64, generator=g)
    x, w = big[:, 32:96], fused[16:48]
    out = torch.full((4, 32), float("nan"))
    assert sk.skinny_gemm(x, w, cfg=SMALL, out=out) is out
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("x_shape,w_shape,glu,why", [
    ((5, 64), (16, 64), False, "more rows than MAX_ROWS"),
    ((2, 48), (16, 48), False, "K not a multiple of bk"),
    ((2, 64), (16, 64), True, "glu without the 2K input"),
    ((2, 64), (16, 32), False, "K mismatch"),
])
def test_unsupported_operands_raise_naming_the_kernel(x_shape, w_shape, glu, why):
    x, w = torch.randn(*x_shape), torch.randn(*w_shape)
    assert not sk.supports(x, w, glu, SMALL), why
    with pytest.raises(ValueError, match="skinny_gemm"):
        sk.skinny_gemm(x, w, glu, SMALL)


def test_dtype_mismatch_and_column_strided_weight_are_not_supported():
    x = torch.randn(2, 64)
    assert not sk.supports(x.double(), torch.randn(16, 64), cfg=SMALL)
    assert not sk.supports(x, torch.randn(64, 16).t(), cfg=SMALL)


def test_setting_parses_and_rejects():
    assert skinny_setting("0") is None
    assert skinny_setting("1") == sk.DEFAULT
    assert skinny_setting("64,512,8,3") == sk.SkinnyConfig(64, 512, 8, 3)
    for bad in ("yes", "64,512,8", "48,512,8,3", "64,512,8,0"):
        with pytest.raises(ValueError, match="HALFMOON_SKINNY_GEMM"):
            skinny_setting(bad)


@pytest.mark.gpu
def test_bf16_on_gpu_matches_cublas_within_a_rounding():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    for M in (1, 2, 4):
        x = torch.randn(M, 2 * 4096, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16, generator=g) / 64
        for glu, want in ((False, F.linear(x[:, :4096], w)), (True, F.linear(silu_mul(x), w))):
            got = sk.skinny_gemm(x if glu else x[:, :4096], w, glu)
            err = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-2)
            assert err.max().item() <= 2 ** -6, (M, glu, err.max().item())
