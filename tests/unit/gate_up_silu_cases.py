"""Cases of the fused gate/up GEMM + SiLU·mul kernel (``engine.gate_up_silu``) in Triton's CPU
interpreter (fp16: the interpreter's numpy has no bf16) against the two-step torch reference, at
tile-boundary shapes. Not collected by itself: ``test_gate_up_silu.py`` runs this file in a fresh
process with ``TRITON_INTERPRET=1`` set before Triton is imported (set later, the interpreter fails
every ``tl.zeros`` with "Cannot call @triton.jit'd outside of the scope of a kernel"). The GPU
comparison with cuBLAS + flashinfer in bf16 is ``python -m bench.gpu gate_up_micro``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from engine.gate_up_silu import Tile, gate_up_silu  # noqa: E402

SMALL = Tile(bm=16, bn=32, bk=32, group_m=2, warps=4, stages=2)


def reference(x, w):
    gu = x.float() @ w.float().T
    i = w.shape[0] // 2
    return F.silu(gu[:, :i]) * gu[:, i:]


@pytest.mark.parametrize("variant,T,I", [("ptr", 37, 96), ("ptr", 16, 80), ("ptr", 1, 32), ("tma", 37, 96),
                                         ("tma", 48, 64)])
def test_matches_silu_of_gate_times_up(variant, T, I):
    g = torch.Generator().manual_seed(T * I)
    x = torch.randn(T, 128, generator=g).half()
    w = (torch.randn(2 * I, 128, generator=g) * 0.1).half()
    out = gate_up_silu(x, w, SMALL, variant)
    assert out.shape == (T, I) and out.dtype == torch.float16
    ref = reference(x, w)
    # one fp16 rounding of the output (the reference rounds nothing)
    assert torch.allclose(out.float(), ref, rtol=2e-3, atol=2e-3), (out.float() - ref).abs().max()


def test_the_gate_and_up_halves_are_not_swapped():
    x = torch.ones(16, 32).half()
    w = torch.cat([torch.full((32, 32), 0.1), torch.zeros(32, 32)]).half()  # gate 3.2, up 0
    assert gate_up_silu(x, w, Tile(bm=16, bn=32, bk=32, group_m=1, warps=4, stages=2)).abs().max() == 0


def test_empty_batch_and_bad_shapes():
    w = torch.zeros(64, 64).half()
    assert gate_up_silu(torch.zeros(0, 64).half(), w, SMALL).shape == (0, 32)
    with pytest.raises(ValueError, match="do not fit"):
        gate_up_silu(torch.zeros(4, 48).half(), torch.zeros(64, 48).half(), SMALL)  # K % bk
    with pytest.raises(ValueError, match="do not fit"):
        gate_up_silu(torch.zeros(4, 64).half(), torch.zeros(63, 64).half(), SMALL)  # 2I odd
    with pytest.raises(ValueError, match="multiple of bn"):
        gate_up_silu(torch.zeros(4, 64).half(), torch.zeros(80, 64).half(), SMALL, "tma")
    with pytest.raises(ValueError, match="variant"):
        gate_up_silu(torch.zeros(4, 64).half(), w, SMALL, "wgmma")
