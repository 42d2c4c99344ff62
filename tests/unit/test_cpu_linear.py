"""Packed CPU linears and the torch fused projections: same results as F.linear / the unfused model
within float32 summation-order tolerance, 121 instead of 211 GEMMs per SmolLM2 decode step, parameter
names and weight ties unchanged, a row-parallel linear packed with its all-reduce kept, and an
unknown ``cpu_linear`` rejected before anything loads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from engine.config import EngineConfig
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.model_runner import ModelRunner
from engine.cpu_kernels import SMALL_GEMM
from engine.models.cpu_linear import (BF16_SMALL_ROWS, SMALL_ROWS, CpuLinear, PackedLinear, bf16_gemm_supported,
                                      fused_linear)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


def _small_gemm_built() -> bool:
    return SMALL_GEMM.load()[0] is not None


needs_bf16 = pytest.mark.skipif(not bf16_gemm_supported(), reason="oneDNN has no native bf16 GEMM on this CPU")


@pytest.mark.parametrize("small_rows", [SMALL_ROWS, 0])  # the small-M kernel up to 64 rows, or oneDNN only
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 8, 13, 17, 64, 65])
def test_packed_linear_matches_f_linear(rows, bias, small_rows):
    """N = 167 is not a multiple of the kernel's 16-row blocks and K = 300 not of its 128-column
    chunks; row counts cover every tile size (1..6) and the 64-row limit on both sides."""
    g = torch.Generator().manual_seed(rows)
    lin = torch.nn.Linear(300, 167, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(167, 300, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(167, generator=g))
    x = torch.randn(rows, 300, generator=g)
    p = PackedLinear.from_linear(lin, small_rows=small_rows)
    assert p.weight is lin.weight and p.bias is lin.bias
    assert p.small_rows == (small_rows if _small_gemm_built() else 0)
    want = F.linear(x, lin.weight, lin.bias)
    torch.testing.assert_close(p(x), want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(p(x.view(1, rows, 300)), want.view(1, rows, 167),
                               atol=1e-4, rtol=1e-5)  # leading dims kept
    wide = torch.randn(rows, 600, generator=g)[:, ::2]  # rows not contiguous
    torch.testing.assert_close(p(wide), F.linear(wide, lin.weight, lin.bias), atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not _small_gemm_built(), reason="small_gemm kernel not built (make kernels)")
@pytest.mark.parametrize("rows", [1, 5, 8, 64])
def test_small_gemm_streams_bf16_weights_and_sums_in_float32(rows):
    """bfloat16 W packed as is: the result is x @ W.float().T up to float32 summation order (x stays
    float32; a bf16 x comes back bf16); N = 167 and K = 300 leave partial blocks and chunks."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(167, 300, generator=g).bfloat16()
    bias = torch.randn(167, generator=g).bfloat16()
    x = torch.randn(rows, 300, generator=g)
    packed = torch.ops.halfmoon.small_gemm_pack(w)
    assert packed.dtype == torch.bfloat16 and packed.shape[1:] == (300, SMALL_GEMM.load()[0].BLOCK)
    want = x @ w.float().T + bias.float()
    torch.testing.assert_close(torch.ops.halfmoon.small_gemm(x, packed, 167, bias), want, atol=1e-4, rtol=1e-5)
    y = torch.ops.halfmoon.small_gemm(x.bfloat16(), packed, 167, None)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), x.bfloat16().float() @ w.float().T, atol=0.1, rtol=1e-2)
    with pytest.raises(RuntimeError, match="float32"):  # float32 weights take float32 x only
        torch.ops.halfmoon.small_gemm(x.bfloat16(), torch.ops.halfmoon.small_gemm_pack(w.float()), 167, None)


@needs_bf16
@pytest.mark.parametrize("small_rows", [SMALL_ROWS, 0])
@pytest.mark.parametrize("rows", [1, 8, 9, 65])
def test_bf16_linear_is_packed_and_matches_f_linear_within_bf16_rounding(rows, small_rows):
    """A bfloat16 weight is packed (the small-M kernel up to ``BF16_SMALL_ROWS`` rows when built,
    oneDNN's native bf16 GEMM above): before, PackedLinear refused it and a bf16 CPU model ran F.linear."""
    g = torch.Generator().manual_seed(rows)
    lin = torch.nn.Linear(300, 167, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(167, 300, generator=g))
    x = torch.randn(rows, 300, generator=g).bfloat16()
    p = PackedLinear.from_linear(lin, small_rows=small_rows)
    assert p.packed.dtype == torch.bfloat16
    assert p.small_rows == (min(small_rows, BF16_SMALL_ROWS) if _small_gemm_built() else 0)
    y = p(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 167)
    want = x.float() @ lin.weight.float().T
    torch.testing.assert_close(y.float(), want, atol=0.15, rtol=1e-2)  # bf16 output rounding of |y| ~ 17


@needs_bf16
def test_a_bf16_cpu_model_packs_every_linear_and_stays_near_float32(model_dir):
    """``--dtype bfloat16`` on the CPU: every GEMM packed in bf16 (half the bytes per decode step);
    the greedy next token of two prompts equals the float32 model's and the logits stay within bf16
    rounding of them."""
    kw = dict(model=str(model_dir), num_pages=16, max_running_requests=2, max_context=64, torch_threads=1)
    bf = ModelRunner(EngineConfig(dtype="bfloat16", **kw))
    fp = ModelRunner(EngineConfig(**kw))
    layer = bf.model.model.layers[0]
    packed = [bf.model._fused.qkv[0], bf.model._fused.gate_up[0], layer.self_attn.o_proj, layer.mlp.down_proj,
              bf.model.lm_head]
    assert all(type(m) is PackedLinear and m.packed.dtype == torch.bfloat16 for m in packed)
    prompts = [list(range(200, 230)), list(range(900, 917))]
    want = _decode_step(fp, prompts)([1234, 4321])
    got = _decode_step(bf, prompts)([1234, 4321])
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    assert (got.float() - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.skipif(not _small_gemm_built(), reason="small_gemm kernel not built (make kernels)")
def test_small_gemm_op_rejects_bad_inputs_with_an_error():
    from engine.cpu_kernels import SMALL_GEMM

    nb = SMALL_GEMM.load()[0].BLOCK  # two native vectors: 16 floats (AVX2) or 32 (AVX-512)
    assert nb in (16, 32)
    w = torch.randn(40, 24)
    packed = torch.ops.halfmoon.small_gemm_pack(w)
    blocks = -(-40 // nb)
    assert packed.shape == (blocks, 24, nb)
    assert torch.equal(packed.permute(0, 2, 1).reshape(-1, 24)[:40], w)  # block j, lane i = row nb*j + i
    assert torch.equal(packed[-1, :, 40 - (blocks - 1) * nb:], torch.zeros(24, blocks * nb - 40))  # rows past N are 0
    with pytest.raises(RuntimeError, match="at most 64 rows"):
        torch.ops.halfmoon.small_gemm(torch.randn(65, 24), packed, 40, None)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.halfmoon.small_gemm(torch.randn(2, 25), packed, 40, None)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.halfmoon.small_gemm(torch.randn(2, 24, dtype=torch.float64), packed, 40, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.halfmoon.small_gemm(torch.randn(2, 24), packed, 40, torch.randn(39))


def test_unbuilt_small_gemm_falls_back_to_onednn_and_says_why_once(monkeypatch, caplog):
    import logging

    monkeypatch.setattr(SMALL_GEMM, "_loaded", (None, "not built (test)"))
    monkeypatch.setattr(SMALL_GEMM, "_said_why", False)
    lin = torch.nn.Linear(32, 48)
    x = torch.randn(3, 32)
    with caplog.at_level(logging.INFO, logger="halfmoon.engine.models"):
        ps = [PackedLinear.from_linear(lin) for _ in range(2)]
    assert all(p.small_rows == 0 and p.small_packed is None for p in ps)
    torch.testing.assert_close(ps[0](x), F.linear(x, lin.weight, lin.bias), atol=1e-4, rtol=1e-5)
    said = [r.getMessage() for r in caplog.records if "not built (test)" in r.getMessage()]
    assert len(said) == 1 and "oneDNN" in said[0]


def test_fused_linear_views_and_output():
    parts = [torch.nn.Linear(32, n, bias=True) for n in (48, 16, 16)]
    x = torch.randn(5, 32)
    want = torch.cat([p(x) for p in parts], -1).detach()
    fused = fused_linear(parts)
    torch.testing.assert_close(fused(x), want)
    w = fused.weight
    for p, off in zip(parts, (0, 48, 64)):  # the originals are row blocks of the fused tensor
        assert p.weight.data_ptr() == w.data_ptr() + off * 32 * 4
        assert p.bias.data_ptr() == fused.bias.data_ptr() + off * 4


def test_a_row_parallel_linear_keeps_its_all_reduce_when_packed():
    """pack_linear packs plain nn.Linear only: a subclass's forward (the row-parallel all-reduce under
    tensor parallelism) is not dropped; the torch fused ops pack its local GEMM and keep the all-reduce."""
    from engine.distributed.parallel_linear import PackedRowParallelLinear, RowParallelLinear
    from engine.models.cpu_linear import pack_linear
    from engine.torch_fused_ops import _pack_out

    row = RowParallelLinear(32, 16, group=None)
    assert pack_linear(row, CpuLinear.PACKED) is row
    packed = _pack_out(row, CpuLinear.PACKED)
    assert isinstance(packed, PackedRowParallelLinear) and packed.weight is row.weight
    assert _pack_out(row, CpuLinear.TORCH) is row
    assert isinstance(pack_linear(torch.nn.Linear(32, 16), CpuLinear.PACKED), PackedLinear)
    assert _pack_out(row, CpuLinear.ONEDNN).small_rows == 0
    assert pack_linear(torch.nn.Linear(32, 16), CpuLinear.ONEDNN).small_rows == 0


def test_cpu_linear_parse_names_the_field():
    assert CpuLinear.parse("packed") is CpuLinear.PACKED and CpuLinear.parse("onednn") is CpuLinear.ONEDNN
    with pytest.raises(ValueError, match="cpu_linear"):
        CpuLinear.parse("mkl")


def test_unknown_cpu_linear_rejected_before_loading():
    with pytest.raises(ValueError, match="cpu_linear"):
        ModelRunner(EngineConfig(model="/nonexistent/model", cpu_linear="fast"))


class _GemmCounter(TorchDispatchMode):
    GEMMS = {"aten.linear.default", "aten.mm.default", "aten.addmm.default", "mkldnn._linear_pointwise.default",
             "halfmoon.small_gemm.default"}

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += str(func) in self.GEMMS
        return func(*args, **(kwargs or {}))


def _decode_step(runner, prompts):
    """Prefill ``prompts``; returns a function running one decode step of all of them (B rows)."""
    rows, lens = [], [len(p) for p in prompts]
    for ids in prompts:
        row = runner.req_to_token_pool.alloc()
        slots = runner.allocator.alloc_slots(0, len(ids) + 1, None)
        runner.req_to_token_pool.write(row, 0, slots)
        runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [row], [0], [ids], slots[:len(ids)]))
        rows.append(row)
    return lambda toks: runner.forward(ForwardBatch.decode(rows, lens, toks, runner.req_to_token_pool.req_to_token))


@pytest.fixture(scope="module")
def runners(model_dir):
    kw = dict(model=str(model_dir), num_pages=16, max_running_requests=2, max_context=64, torch_threads=1)
    plain = ModelRunner(EngineConfig(fused_ops=False, cpu_linear="torch", **kw))
    fused = ModelRunner(EngineConfig(**kw))  # the default: fused projections, packed weights
    return plain, fused


def test_default_cpu_decode_step_runs_121_gemms_and_matches_unfused(runners):
    plain, fused = runners
    assert type(fused.model.lm_head) is PackedLinear
    prompts = [list(range(200, 230)), list(range(900, 917))]  # B=2: the small-M kernel when built
    steps = [_decode_step(r, prompts) for r in runners]
    counts, logits = [], []
    for step in steps:
        with _GemmCounter() as c:
            logits.append(step([1234, 4321]))
        counts.append(c.n)
    layers = plain.model_config.num_layers
    assert counts == [7 * layers + 1, 4 * layers + 1]  # 211 and 121 for SmolLM2's 30 layers
    torch.testing.assert_close(logits[1], logits[0], atol=2e-3, rtol=0)
    assert logits[1].argmax(-1).tolist() == logits[0].argmax(-1).tolist()


def test_fusion_keeps_parameter_names_and_ties(runners):
    plain, fused = runners
    assert list(fused.model.state_dict()) == list(plain.model.state_dict())
    assert fused.model.lm_head.weight is fused.model.model.embed_tokens.weight  # SmolLM2 ties them
    released = 0
    for name, a in plain.model.state_dict().items():
        b = fused.model.state_dict()[name]
        if name.endswith("_proj.weight"):  # packed: the row-major copy is released
            assert b.numel() == 0, name
            released += a.numel() * 4
        else:  # norms, the embedding and the lm_head tied to it keep their values
            assert torch.equal(a, b), name
    assert released > 300 * 2**20  # SmolLM2-135M's 30 layers of projections


def test_packed_model_holds_no_row_major_copy_of_its_projections(runners):
    """Three copies of every linear weight (row-major, oneDNN's, the kernel's) ran the 24 GB test box
    out of memory under the parallel suite; the row-major one goes once packed, layer by layer."""
    _, fused = runners
    layer = fused.model.model.layers[0]
    for lin in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj):
        assert lin.weight.numel() == 0
    ops = fused.model._fused
    assert ops.qkv[0].weight.numel() == 0 and ops.gate_up[0].weight.numel() == 0
    x = torch.randn(3, 576)
    assert ops.qkv[0](x).shape == (3, 960)  # still runs on its packed copies
    emb = fused.model.model.embed_tokens.weight
    assert emb.shape == (49152, 576) and fused.model.lm_head.weight is emb


def test_cpu_linear_flag_reaches_the_config_and_bad_values_exit():
    import argparse

    from engine.engine_args import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args(["--cpu-linear", "torch"])).cpu_linear == "torch"
    assert engine_config_from_args(parser.parse_args([])).cpu_linear == "packed"
    with pytest.raises(SystemExit):
        parser.parse_args(["--cpu-linear", "mkl"])
