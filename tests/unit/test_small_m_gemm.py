"""The small-batch GEMM choice of the fused GPU path (``engine.small_m_gemm``, used by
``engine.fused_ops``): which mode the env picks, which projections tinygemm takes, and (GPU) that its
outputs match an fp32 reference and the model still matches transformers with it on, in CUDA-graph decode."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.nn.functional as F

from engine.small_m_gemm import (DEFAULT_SMALL_M_PROJECTIONS, PROJECTIONS, SMALL_M_ROWS, small_m_gemm_mode,
                              small_m_projections, takes_small_m_gemm)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_mode_comes_from_env_and_rejects_unknown_values(monkeypatch):
    monkeypatch.delenv("HALFMOON_SMALL_M_GEMM", raising=False)
    assert small_m_gemm_mode(True) == "tinygemm"  # auto
    assert small_m_gemm_mode(False) == "cublas"
    for mode in ("cublas", "tinygemm", "tinygemm_nopdl"):
        monkeypatch.setenv("HALFMOON_SMALL_M_GEMM", mode)
        assert small_m_gemm_mode(True) == mode
    monkeypatch.setenv("HALFMOON_SMALL_M_GEMM", "cublas")
    assert small_m_gemm_mode(False) == "cublas"
    monkeypatch.setenv("HALFMOON_SMALL_M_GEMM", "tinygemm")
    with pytest.raises(ValueError, match="sm90"):  # asked for, not there: said, not ignored
        small_m_gemm_mode(False)
    with pytest.raises(ValueError, match="bfloat16"):  # tinygemm is bf16 only
        small_m_gemm_mode(True, torch.float16)
    monkeypatch.setenv("HALFMOON_SMALL_M_GEMM", "auto")
    assert small_m_gemm_mode(True, torch.bfloat16) == "tinygemm"
    assert small_m_gemm_mode(True, torch.float16) == "cublas"
    monkeypatch.setenv("HALFMOON_SMALL_M_GEMM", "tinygem")
    with pytest.raises(ValueError, match="HALFMOON_SMALL_M_GEMM='tinygem'"):
        small_m_gemm_mode(True)


@pytest.mark.parametrize("var,value", [("HALFMOON_SMALL_M_GEMM", "fast"), ("HALFMOON_SMALL_M_GEMM_ON", "lm_head"),
                                       ("HALFMOON_DECODE_GRAPH_BLAS", "cublass")])
def test_model_runner_rejects_a_bad_switch_before_loading_anything(monkeypatch, var, value):
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner

    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):  # the model path does not exist: nothing was loaded
        ModelRunner(EngineConfig(model="/nonexistent/model", load_format="dummy"))


def test_projections_come_from_env_and_reject_unknown_names(monkeypatch):
    monkeypatch.delenv("HALFMOON_SMALL_M_GEMM_ON", raising=False)
    assert small_m_projections() == frozenset(DEFAULT_SMALL_M_PROJECTIONS) == {"o", "down"}
    monkeypatch.setenv("HALFMOON_SMALL_M_GEMM_ON", ",".join(PROJECTIONS))
    assert small_m_projections() == frozenset(PROJECTIONS)
    monkeypatch.setenv("HALFMOON_SMALL_M_GEMM_ON", "o, down")
    assert small_m_projections() == {"o", "down"}
    monkeypatch.setenv("HALFMOON_SMALL_M_GEMM_ON", "")
    assert small_m_projections() == frozenset()  # none: every projection on cuBLAS
    monkeypatch.setenv("HALFMOON_SMALL_M_GEMM_ON", "o,lm_head")
    with pytest.raises(ValueError, match="lm_head"):
        small_m_projections()


class _Row(torch.nn.Linear):
    """Stands in for a tensor-parallel row-parallel projection: a Linear subclass with its own call."""

    def forward(self, x):
        return torch.full((x.shape[0], self.out_features), 7.0, dtype=x.dtype)


def test_linear_and_project_dispatch_by_projection_size_and_module_type():
    from engine.fused_ops import FusedOps

    calls = []

    def fake_tinygemm(x, w, out, bias, pdl):  # records and writes a recognisable value
        calls.append((x.shape[0], w.shape[0], bias is not None, pdl))
        out.fill_(3.0)

    ops = FusedOps.__new__(FusedOps)  # the dispatch only: no model, no flashinfer
    ops.small_m, ops.small_m_pdl, ops.small_m_on, ops.small_m_calls = fake_tinygemm, True, frozenset({"o", "down"}), 0
    bf = torch.bfloat16
    x, w, b = torch.ones(2, 64, dtype=bf), torch.ones(32, 64, dtype=bf), torch.ones(32, dtype=bf)
    assert (ops.linear("o", x, w, b) == 3).all() and calls == [(2, 32, True, True)]
    assert (ops.linear("qkv", x, w, b) == 65).all()  # not enabled for q/k/v: F.linear (64 + bias 1)
    assert (ops.linear("o", torch.ones(9, 64, dtype=bf), w) == 64).all()  # 9 rows: a second tile, cuBLAS
    lin = torch.nn.Linear(64, 32, bias=False).to(bf)
    calls.clear()
    assert (ops.project("down", lin, torch.ones(1, 64, dtype=bf)) == 3).all() and calls == [(1, 32, False, True)]
    row = _Row(64, 32, bias=False).to(bf)
    assert (ops.project("down", row, torch.ones(1, 64, dtype=bf)) == 7).all() and len(calls) == 1  # its own call
    assert ops.small_m_calls == 2


def test_only_small_contiguous_bf16_tile_aligned_gemms_qualify():
    bf = torch.bfloat16
    w = torch.zeros(96, 128, dtype=bf)
    assert takes_small_m_gemm(torch.zeros(1, 128, dtype=bf), w)
    assert takes_small_m_gemm(torch.zeros(SMALL_M_ROWS, 128, dtype=bf), w)
    assert not takes_small_m_gemm(torch.zeros(SMALL_M_ROWS + 1, 128, dtype=bf), w)  # a second tile
    assert not takes_small_m_gemm(torch.zeros(0, 128, dtype=bf), w)
    assert not takes_small_m_gemm(torch.zeros(1, 128, dtype=torch.float16), w.half())
    assert not takes_small_m_gemm(torch.zeros(1, 128), w.float())
    assert not takes_small_m_gemm(torch.zeros(2, 256, dtype=bf)[:, :128], w)  # row-strided view
    assert not takes_small_m_gemm(torch.zeros(1, 128, dtype=bf), torch.zeros(88, 128, dtype=bf))  # N % 16
    assert not takes_small_m_gemm(torch.zeros(1, 96, dtype=bf), torch.zeros(96, 96, dtype=bf))  # K % 64
    assert not takes_small_m_gemm(torch.zeros(1, 64, dtype=bf), w)  # K mismatch


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("pdl", [False, True])
def test_tinygemm_matches_an_fp32_reference_on_decode_shapes(pdl):
    import flashinfer

    g = torch.Generator(device="cuda").manual_seed(0)
    for N, K in ((6144, 4096), (4096, 4096), (4096, 14336)):
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) / K ** 0.5
        for M in (1, 3, 8):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            flashinfer.gemm.tinygemm_bf16(x, w, out, None, pdl)
            ref = F.linear(x.float(), w.float())
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert err <= 1e-2, (N, K, M, err)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape,mode,on", [("llama-3.1-8b", "auto", None),
                                           ("llama-3.1-8b", "tinygemm", "qkv,o,gate_up,down"),
                                           ("llama-3.1-8b", "tinygemm_nopdl", "qkv,o,gate_up,down"),
                                           ("qwen2.5-7b", "tinygemm", "qkv,o,down")])  # q/k/v bias
def test_model_matches_transformers_with_tinygemm(monkeypatch, shape, mode, on):
    from bench.gpu import model_vs_transformers
    from tests.unit.test_gpu_flashinfer import TINY

    monkeypatch.setenv("HALFMOON_SMALL_M_GEMM", mode)
    if on is None:
        monkeypatch.delenv("HALFMOON_SMALL_M_GEMM_ON", raising=False)
    else:
        monkeypatch.setenv("HALFMOON_SMALL_M_GEMM_ON", on)
    with tempfile.TemporaryDirectory() as tmp:
        bf = model_vs_transformers(shape, 2, "bf16", tmp, overrides=TINY)
    assert bf["cuda_graph"] and bf["fused_ops"], bf
    assert bf["small_m_gemm_calls"] > 0, bf  # the decode graphs' projections took tinygemm
    assert bf["rel_err_vs_hf_fp32"] <= 2e-2, bf
    assert bf["rel_err_vs_hf_bf16"] <= 2e-2, bf
