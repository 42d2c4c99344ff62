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
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("B,C", [(1, 1024), (3, 777), (8, 4096), (40, 300)])
def test_compiled_kernel_matches_the_reference_on_gpu(B, C, pdl):
    """bf16 on the GPU, compiled: the in-kernel merge (one ticket per program, the last merges) holds
    across 20 launches, each equal to the float32 reference within bf16 rounding. With ``pdl`` each
    launch follows a kernel that writes q (programmatic dependent launch: the kernel must wait for it)."""
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
    q_src = q.clone()
    for i in range(20):
        if pdl:  # q rewritten by the kernel just before, with a wrong value first
            q.fill_(float(i + 1))
            q.copy_(q_src)
        out = att(q, k, v, r2t, rows, seq, pdl=pdl)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    assert int(att.counter.abs().sum()) == 0


def test_the_launch_shape_follows_the_batch_size_and_sizes_the_workspace():
    """Without a config each launch takes ``default_config`` of its batch size (128-token tiles and one
    split within MID_BATCH_ROWS, two stages from LARGE_FROM_BATCH up), and the partials workspace
    holds the largest batch x splits of any of them."""
    from engine.attention.split_kv_decode import (LARGE_BATCH_CONFIG, LARGE_FROM_BATCH, MID_BATCH_CONFIG,
                                                  MID_BATCH_ROWS, SMALL_BATCH_CONFIG, SplitKVDecode,
                                                  default_config, num_splits)

    assert default_config(1) == SMALL_BATCH_CONFIG and default_config(LARGE_FROM_BATCH - 1) == SMALL_BATCH_CONFIG
    assert default_config(32) == MID_BATCH_CONFIG and default_config(MID_BATCH_ROWS[1]) == MID_BATCH_CONFIG
    assert num_splits(32, 8, 132, MID_BATCH_CONFIG.ctas_per_sm) == 1  # one split: the kernel merges nothing
    assert default_config(MID_BATCH_ROWS[1] + 1) == LARGE_BATCH_CONFIG and default_config(256) == LARGE_BATCH_CONFIG
    att = SplitKVDecode(32, 8, 128, 16, max_batch=64, device="cpu", sms=132)
    assert att.config_for(1) == SMALL_BATCH_CONFIG and att.config_for(64) == LARGE_BATCH_CONFIG
    assert att.config_for(32) == MID_BATCH_CONFIG
    most = max(b * num_splits(b, 8, 132, default_config(b).ctas_per_sm) for b in range(1, 65))
    assert att.part_ml.numel() == most * 8 * 4 * 2
    fixed = SplitKVDecode(32, 8, 128, 16, max_batch=64, device="cpu", sms=132, config=SMALL_BATCH_CONFIG)
    assert fixed.config_for(64) == SMALL_BATCH_CONFIG  # an explicit config holds for every batch size
