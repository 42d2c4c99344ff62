"""The ``decode_glue`` kernel (residual add + RMSNorm, RoPE in place, SiLU·mul) and the layer loop
that uses it: the same bits as the torch ops it replaces, in float32 and bfloat16, so a model's
logits do not change when it is on; on by default for a CPU model once ``make kernels`` built it;
bad inputs raise instead of writing out of bounds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.cpu_kernels import DECODE_GLUE
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.model_runner import ModelRunner
from engine.models.rotary import Rotary, apply_rotary

GLUE = DECODE_GLUE.load()[0]
pytestmark = pytest.mark.skipif(GLUE is None, reason="decode_glue kernel not built (make kernels)")
DTYPES = [torch.float32, torch.bfloat16]


def _torch_norm(x, w, eps):  # engine.models.llama.RMSNorm's torch path
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 576), (8, 576), (3, 4096), (300, 576)])  # 300: rows in parallel
def test_add_rms_norm_equals_the_torch_ops_bit_for_bit(dtype, rows, n):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    h = torch.randn(rows, n, generator=g).to(dtype)
    w = torch.randn(n, generator=g).to(dtype)
    stream = x.clone()
    out = GLUE.add_rms_norm(stream, h, w, 1e-5)
    assert torch.equal(stream, x + h)  # the residual add, in place
    assert torch.equal(out, _torch_norm(x + h, w, 1e-5))
    alone = x.clone()
    assert torch.equal(GLUE.add_rms_norm(alone, None, w, 1e-6), _torch_norm(x, w, 1e-6))
    assert torch.equal(alone, x)  # no h: x untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 8, 300])
def test_rope_on_fused_qkv_rows_equals_apply_rotary_and_leaves_v(dtype, rows):
    H, KVH, D = 9, 3, 64
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (H + 2 * KVH) * D, generator=g).to(dtype)
    cos, sin = Rotary(D, 100000.0, None).cos_sin(torch.arange(rows) + 977, dtype)
    q, k = qkv[:, :H * D].reshape(rows, H, D), qkv[:, H * D:(H + KVH) * D].reshape(rows, KVH, D)
    got = qkv.clone()
    GLUE.rope_(got, cos, sin, H + KVH, D)
    assert torch.equal(got[:, :H * D].view(rows, H, D), apply_rotary(q, cos, sin))
    assert torch.equal(got[:, H * D:(H + KVH) * D].view(rows, KVH, D), apply_rotary(k, cos, sin))
    assert torch.equal(got[:, (H + KVH) * D:], qkv[:, (H + KVH) * D:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (8, 1536), (64, 14336)])
def test_silu_mul_equals_f_silu_times_up(dtype, rows, inter):
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(GLUE.silu_mul(gate_up), F.silu(gate) * up)


def test_bad_inputs_raise_before_writing():
    x = torch.randn(2, 8)
    before = x.clone()
    with pytest.raises(RuntimeError, match="weight"):
        GLUE.add_rms_norm(x, None, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="h must be"):
        GLUE.add_rms_norm(x, torch.randn(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        GLUE.add_rms_norm(x.double(), None, torch.ones(8).double(), 1e-5)
    with pytest.raises(RuntimeError, match="exceeds the row"):
        GLUE.rope_(x, torch.ones(2, 4), torch.ones(2, 4), 3, 4)
    with pytest.raises(RuntimeError, match="cos and sin"):
        GLUE.rope_(x, torch.ones(1, 4), torch.ones(1, 4), 2, 4)
    with pytest.raises(RuntimeError, match="2I"):
        GLUE.silu_mul(torch.randn(2, 7))
    assert torch.equal(x, before)


def _prefill_then_decode(runner, prompts, tokens):
    """Logits of a prefill of ``prompts`` (one batch) and of one decode step after it."""
    rows, lens, slots_all = [], [len(p) for p in prompts], []
    for ids in prompts:
        row = runner.req_to_token_pool.alloc()
        slots = runner.allocator.alloc_slots(0, len(ids) + 1, None)
        runner.req_to_token_pool.write(row, 0, slots)
        rows.append(row)
        slots_all.append(slots[:len(ids)])
    pre = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, rows, [0] * len(rows), prompts,
                                            torch.cat(slots_all)))
    dec = runner.forward(ForwardBatch.decode(rows, lens, tokens, runner.req_to_token_pool.req_to_token))
    return pre, dec


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_logits_are_the_same_bits_with_and_without_the_kernel(model_dir, dtype):
    kw = dict(model=str(model_dir), num_pages=16, max_running_requests=2, max_context=64, torch_threads=1, dtype=dtype)
    on = ModelRunner(EngineConfig(**kw))
    off = ModelRunner(EngineConfig(**kw))
    assert on.model._fused.glue is GLUE  # on by default
    off.model._fused.glue = None  # the torch ops
    prompts = [list(range(200, 230)), list(range(900, 917))]
    got = _prefill_then_decode(on, prompts, [1234, 4321])
    want = _prefill_then_decode(off, prompts, [1234, 4321])
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_an_unbuilt_kernel_leaves_the_torch_ops_and_says_why_once(model_dir, monkeypatch, caplog):
    monkeypatch.setattr(DECODE_GLUE, "_loaded", (None, "not built for this machine (test)"))
    monkeypatch.setattr(DECODE_GLUE, "_said_why", False)
    kw = dict(model=str(model_dir), num_pages=16, max_running_requests=2, max_context=64, torch_threads=1)
    with caplog.at_level("INFO", logger="halfmoon.engine.models"):
        runners = [ModelRunner(EngineConfig(**kw)) for _ in range(2)]
    assert all(r.model._fused.glue is None for r in runners)
    said = [r.getMessage() for r in caplog.records if "decode glue kernel not used" in r.getMessage()]
    assert said == ["decode glue kernel not used, norms, RoPE and SiLU·mul run as torch ops: "
                    "not built for this machine (test)"]
