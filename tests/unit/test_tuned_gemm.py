"""The autotuned GEMM of the decode graphs (``engine.tuned_gemm``, used by ``engine.fused_ops`` and
``engine.cuda_graph_runner``): the env switches, which GEMMs it takes and when, the autotuner scope it
opens per bucket, and (GPU) that its outputs match an fp32 reference and the model still matches
transformers with it on in CUDA-graph decode."""

from __future__ import annotations

import contextlib
import tempfile

import pytest
import torch
import torch.nn.functional as F

from engine.small_m_gemm import PROJECTIONS
from engine.tuned_gemm import (ALL_ROWS, TUNED_GEMM_BACKENDS, TunedGemm, tuned_gemm_backend, tuned_projections,
                                tuned_rows)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
bf = torch.bfloat16


class _FakeFlashinfer:
    """Records what TunedGemm asks of flashinfer: the autotune contexts and the mm_bf16 calls."""

    def __init__(self):
        self.scopes, self.calls, self.open = [], [], 0

    @contextlib.contextmanager
    def autotune(self, tune_mode=True, cache=None, tuning_buckets=None):
        self.scopes.append((tune_mode, cache, tuning_buckets))
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1

    def mm_bf16(self, a, b, backend):
        self.calls.append((tuple(a.shape), tuple(b.shape), b.stride(-2) == 1, backend, self.open))
        return torch.full((a.shape[0], b.shape[1]), 5.0, dtype=a.dtype)


def test_backend_and_projections_come_from_env_and_reject_unknown_values(monkeypatch):
    monkeypatch.delenv("HALFMOON_TUNED_GEMM", raising=False)
    monkeypatch.delenv("HALFMOON_TUNED_GEMM_ON", raising=False)
    monkeypatch.delenv("HALFMOON_TUNED_GEMM_ROWS", raising=False)
    assert tuned_gemm_backend() == "off"  # it won and lost by machine: not on by default
    assert tuned_projections() == frozenset(PROJECTIONS)
    assert tuned_rows() == ALL_ROWS
    monkeypatch.setenv("HALFMOON_TUNED_GEMM_ROWS", " 8-64 ")
    assert tuned_rows() == (8, 64)
    for bad in ("8", "8-", "a-b", "0-4", "16-8", "1-2-3"):
        monkeypatch.setenv("HALFMOON_TUNED_GEMM_ROWS", bad)
        with pytest.raises(ValueError, match="HALFMOON_TUNED_GEMM_ROWS"):
            tuned_rows()
    for backend in TUNED_GEMM_BACKENDS:
        monkeypatch.setenv("HALFMOON_TUNED_GEMM", backend)
        assert tuned_gemm_backend() == backend
    monkeypatch.setenv("HALFMOON_TUNED_GEMM", "cublas")
    with pytest.raises(ValueError, match="HALFMOON_TUNED_GEMM='cublas'"):
        tuned_gemm_backend()
    monkeypatch.setenv("HALFMOON_TUNED_GEMM_ON", "qkv, gate_up")
    assert tuned_projections() == {"qkv", "gate_up"}
    monkeypatch.setenv("HALFMOON_TUNED_GEMM_ON", " , ")
    with pytest.raises(ValueError, match="names no projection"):
        tuned_projections()
    monkeypatch.setenv("HALFMOON_TUNED_GEMM_ON", "qkv,lm_head")
    with pytest.raises(ValueError, match="lm_head"):
        tuned_projections()


def test_asked_for_where_it_cannot_run_is_an_error_not_ignored(monkeypatch):
    monkeypatch.delenv("HALFMOON_TUNED_GEMM_ROWS", raising=False)
    monkeypatch.setenv("HALFMOON_TUNED_GEMM", "off")
    assert TunedGemm.from_env(_FakeFlashinfer(), torch.device("cpu"), bf) is None
    monkeypatch.delenv("HALFMOON_TUNED_GEMM")
    assert TunedGemm.from_env(_FakeFlashinfer(), torch.device("cpu"), torch.float32) is None
    monkeypatch.setenv("HALFMOON_TUNED_GEMM", "cublaslt")
    with pytest.raises(ValueError, match="sm80"):
        TunedGemm.from_env(_FakeFlashinfer(), torch.device("cpu"), bf)
    with pytest.raises(ValueError, match="HALFMOON_TUNED_GEMM='off'"):
        TunedGemm(_FakeFlashinfer(), "off", frozenset(PROJECTIONS))


def test_auto_without_the_cute_dsl_is_refused_at_start_not_at_the_first_capture(monkeypatch):
    # flashinfer 0.6.18's auto backend includes TGV, built with the CuTe DSL: without it every
    # mm_bf16(backend="auto") raised LibraryError (H100, session 14 small_gemm), so the graph
    # runner's first warm-up would fail after the model had loaded
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cutlass" else real(name, *a))
    monkeypatch.setenv("HALFMOON_TUNED_GEMM", "auto")
    with pytest.raises(ValueError, match="nvidia-cutlass-dsl"):
        TunedGemm.from_env(_FakeFlashinfer(), torch.device("cpu"), bf)


@pytest.mark.parametrize("var,value", [("HALFMOON_TUNED_GEMM", "fastest"), ("HALFMOON_TUNED_GEMM_ON", "embed"),
                                       ("HALFMOON_TUNED_GEMM_ROWS", "32-2")])
def test_model_runner_rejects_a_bad_switch_before_loading_anything(monkeypatch, var, value):
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner

    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):  # the model path does not exist: nothing was loaded
        ModelRunner(EngineConfig(model="/nonexistent/model", load_format="dummy"))


def test_a_scope_tunes_or_looks_up_at_exactly_its_rows_and_is_the_only_place_it_runs():
    fi = _FakeFlashinfer()
    t = TunedGemm(fi, "cublaslt", frozenset({"qkv", "gate_up"}), cache="/tmp/tuned.json")
    x, w = torch.ones(12, 64, dtype=bf), torch.ones(32, 64, dtype=bf)
    assert not t.takes("qkv", x, w, None)  # outside a scope: eager forwards keep F.linear
    with t.scope(12, tune=True):
        assert t.active and fi.open == 1
        assert t.takes("qkv", x, w, None)
        assert not t.takes("o", x, w, None)  # not enabled
        assert not t.takes("qkv", x, w, torch.ones(32, dtype=bf))  # bias: cuBLASLt's runner takes none
        assert not t.takes("qkv", x.half(), w.half(), None)
        assert not t.takes("qkv", torch.ones(12, 128, dtype=bf)[:, :64], w, None)  # row-strided view
        assert not t.takes("qkv", torch.ones(12, 32, dtype=bf), w, None)  # K mismatch
        out = t(x, w)
    assert not t.active and fi.open == 0
    with t.scope(12, tune=False):
        t(x, w)
    # the weight goes K-major ([K, N] view of [N, K]), the backend named, each call inside its scope
    assert fi.calls == [((12, 64), (64, 32), True, "cublaslt", 1)] * 2
    assert fi.scopes == [(True, "/tmp/tuned.json", (12,)), (False, "/tmp/tuned.json", (12,))]
    assert (out == 5).all() and t.calls == 2
    with pytest.raises(RuntimeError), t.scope(4, tune=False):
        raise RuntimeError("a failed capture")
    assert not t.active and fi.open == 0  # left on no path


def test_buckets_outside_its_rows_open_no_scope_and_keep_f_linear():
    fi = _FakeFlashinfer()
    t = TunedGemm(fi, "cublaslt", frozenset(PROJECTIONS), rows=(2, 32))
    x, w = torch.ones(1, 64, dtype=bf), torch.ones(32, 64, dtype=bf)
    for rows in (1, 33, 64, 128):
        with t.scope(rows, tune=True):
            assert not t.active and not t.takes("qkv", x, w, None)
    assert fi.scopes == []
    for rows in (2, 8, 32):
        with t.scope(rows, tune=True):
            assert t.active
    assert [s[2] for s in fi.scopes] == [(2,), (8,), (32,)]


def test_the_rows_from_env_reach_the_tuned_gemm(monkeypatch):
    import engine.tuned_gemm as tg

    monkeypatch.setenv("HALFMOON_TUNED_GEMM", "cublaslt")
    monkeypatch.delenv("HALFMOON_TUNED_GEMM_ROWS", raising=False)
    monkeypatch.setattr(tg, "tuned_gemm_available", lambda device, fi: True)  # as on an sm80+ GPU
    t = TunedGemm.from_env(_FakeFlashinfer(), torch.device("cpu"), bf)
    assert t.backend == "cublaslt" and t.rows == ALL_ROWS and t.on == frozenset(PROJECTIONS)
    monkeypatch.setenv("HALFMOON_TUNED_GEMM_ROWS", "2-16")
    assert TunedGemm.from_env(_FakeFlashinfer(), torch.device("cpu"), bf).rows == (2, 16)


def test_linear_dispatch_prefers_tinygemm_then_the_tuned_gemm_then_f_linear():
    from engine.fused_ops import FusedOps

    small = []

    def fake_tinygemm(x, w, out, bias, pdl):
        small.append(x.shape[0])
        out.fill_(3.0)

    fi = _FakeFlashinfer()
    ops = FusedOps.__new__(FusedOps)  # the dispatch only: no model, no flashinfer
    ops.small_m, ops.small_m_pdl, ops.small_m_on, ops.small_m_calls = fake_tinygemm, True, frozenset({"o"}), 0
    ops.tuned = TunedGemm(fi, "auto", frozenset(PROJECTIONS))
    x, w = torch.ones(2, 64, dtype=bf), torch.ones(32, 64, dtype=bf)
    assert (ops.linear("qkv", x, w) == 64).all()  # no scope: F.linear
    with ops.tuned.scope(2, tune=False):
        assert (ops.linear("o", x, w) == 3).all() and small == [2]  # tinygemm first
        assert (ops.linear("qkv", x, w) == 5).all() and len(fi.calls) == 1  # then the tuned GEMM
        assert (ops.linear("qkv", x, w, torch.ones(32, dtype=bf)) == 65).all()  # bias: F.linear
    assert ops.tuned.calls == 1


def test_the_graph_runner_tunes_in_the_warm_up_and_looks_up_in_the_capture():
    """The order of scopes and forwards in a bucket's capture, on a runner built without CUDA: the
    capture's CUDA calls are stubbed, the scopes are the real TunedGemm's on a recording flashinfer."""
    from engine import cuda_graph_runner as cgr

    fi = _FakeFlashinfer()
    tuned = TunedGemm(fi, "cublaslt", frozenset(PROJECTIONS))
    log = []

    class Model:
        _fused = type("Ops", (), {"tuned": tuned})()

        def __call__(self, batch, planned):
            log.append(("forward", tuned.active, fi.scopes[-1] if fi.open else None))

    class Graph:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            log.append(("capture",))

        def __exit__(self, *a):
            return False

    r = cgr.CudaGraphRunner.__new__(cgr.CudaGraphRunner)
    r.model, r.runner, r.device, r.mempool = Model(), None, "cpu", None
    r.indptr, r.wrappers, r.graphs, r.logits = {}, {}, {}, {}
    r.backend = type("B", (), {"make_decode_wrapper": lambda self, b, i, p: None})()
    r.indices, r.split_kv, r.attn = None, None, {24: "flashinfer"}  # flashinfer's decode wrapper
    r._plan = lambda b, batch: None
    r._static_batch = lambda b: None
    r._fill_page_ids = lambda b: None
    with pytest.MonkeyPatch.context() as m:
        m.setattr(cgr, "_Planned", lambda backend, wrapper: None)
        m.setattr(torch.cuda, "Stream", lambda device: type("S", (), {"wait_stream": lambda s, o: None})())
        m.setattr(torch.cuda, "current_stream", lambda device: type("S", (), {"wait_stream": lambda s, o: None})())
        m.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        m.setattr(torch.cuda, "CUDAGraph", lambda: object())
        m.setattr(torch.cuda, "graph", Graph)
        r._capture_with_current_blas(24)
    assert log == [("forward", True, (True, None, (24,))), ("forward", True, (True, None, (24,))),
                   ("capture",), ("forward", True, (False, None, (24,)))]
    assert not tuned.active and fi.open == 0


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("backend", ["cublaslt", "cudnn"])  # auto: needs the CuTe DSL, not carried
def test_tuned_gemm_matches_an_fp32_reference_in_a_graph(backend):
    import flashinfer

    t = TunedGemm(flashinfer, backend, frozenset(PROJECTIONS))
    g = torch.Generator(device="cuda").manual_seed(0)
    for N, K in ((6144, 4096), (4096, 14336)):
        w = torch.randn(N, K, device="cuda", dtype=bf, generator=g) / K ** 0.5
        for M in (1, 24, 128):
            x = torch.randn(M, K, device="cuda", dtype=bf, generator=g)
            with t.scope(M, tune=True):
                t(x, w)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), t.scope(M, tune=False):
                out = t(x, w)
            x.copy_(torch.randn(M, K, device="cuda", dtype=bf, generator=g))  # fresh input, same buffer
            graph.replay()
            ref = F.linear(x.float(), w.float())
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert err <= 1e-2, (backend, N, K, M, err)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("backend", ["cublaslt", "cudnn"])
def test_model_matches_transformers_with_the_tuned_gemm(monkeypatch, backend):
    from bench.gpu import model_vs_transformers
    from tests.unit.test_gpu_flashinfer import TINY

    monkeypatch.setenv("HALFMOON_TUNED_GEMM", backend)
    monkeypatch.delenv("HALFMOON_TUNED_GEMM_ON", raising=False)
    with tempfile.TemporaryDirectory() as tmp:
        bf16 = model_vs_transformers("llama-3.1-8b", 2, "bf16", tmp, overrides=TINY)
    assert bf16["cuda_graph"] and bf16["fused_ops"], bf16
    assert bf16["tuned_gemm_calls"] > 0, bf16  # the decode graphs' projections took it
    assert bf16["rel_err_vs_hf_fp32"] <= 2e-2, bf16
    assert bf16["rel_err_vs_hf_bf16"] <= 2e-2, bf16
