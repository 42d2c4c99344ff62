"""The split-KV decode kernel (``engine.attention.split_kv_decode``) in Triton's CPU interpreter:
runs ``split_kv_decode_cases.py`` in a fresh process with ``TRITON_INTERPRET=1`` (see its docstring)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_interpreted_cases_pass():
    cases = Path(__file__).with_name("split_kv_decode_cases.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
                       env=env, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "10 passed" in r.stdout, r.stdout[-2000:]  # every case ran: none skipped or deselected


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("B,C", [(1, 1024), (3, 777), (8, 4096), (40, 300)])
def test_compiled_kernel_matches_the_reference_on_gpu(B, C):
    """bf16 on the GPU, compiled: the in-kernel merge (one ticket per program, the last merges) holds
    across 20 launches, each equal to the float32 reference within bf16 rounding."""
    import torch

    from engine.attention.split_kv_decode import SplitKVDecode, reference

    g = torch.Generator(device="cuda").manual_seed(B * C)
    H, KVH, D, PS = 32, 8, 128, 16
    npr = -(-C // PS)
    P = B * npr + 1
    region = torch.randn(P, 2, 2, PS, KVH, D, device="cuda", generator=g).bfloat16()  # page-major, 2 layers
    k, v = region[:, 1, 0], region[:, 1, 1]
    table = torch.randperm(P - 1, device="cuda", generator=g).view(B, npr)
    t = torch.arange(npr * PS, device="cuda")
    r2t = (table[:, t // PS] * PS + t % PS).to(torch.int32)
    rows = torch.arange(B, device="cuda")
    seq = torch.tensor([C - (i % 5) for i in range(B)], device="cuda")
    q = torch.randn(B, H + 2 * KVH, D, device="cuda", generator=g).bfloat16()[:, :H]
    att = SplitKVDecode(H, KVH, D, PS, B, "cuda")
    ref = reference(q, k, v, r2t, rows, seq)
    for _ in range(20):
        out = att(q, k, v, r2t, rows, seq)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    assert int(att.counter.abs().sum()) == 0
