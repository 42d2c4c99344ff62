"""The GPU path's env switches (``engine.gpu_env``): a switch set where it would have no effect is an
error naming it, raised when the model runner starts and before anything is loaded; every switch
still takes effect where its part runs, and nothing set starts any engine."""

from __future__ import annotations

import pytest
import torch

from engine.gpu_env import FLASHINFER_SWITCHES, TUNED_SUB_SWITCHES, GpuPaths, check_gpu_env

ALL_ON = GpuPaths(flashinfer_ops=True, graphs=True, flashinfer_attention=True)
CPU = GpuPaths(flashinfer_ops=False, graphs=False, flashinfer_attention=False)
ALL_SWITCHES = ("HALFMOON_SMALL_M_GEMM", "HALFMOON_SMALL_M_GEMM_ON", "HALFMOON_FUSED_ROPE_STORE",
                "HALFMOON_TUNED_GEMM", *TUNED_SUB_SWITCHES, "HALFMOON_DECODE_GRAPH_BLAS", "HALFMOON_DECODE_ATTN", *FLASHINFER_SWITCHES)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ALL_SWITCHES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("paths", [CPU, ALL_ON, GpuPaths(True, False, True), GpuPaths(False, False, True)])
def test_nothing_set_is_fine_for_every_engine(paths):
    check_gpu_env(paths)


@pytest.mark.parametrize("var,value", [("HALFMOON_SMALL_M_GEMM", "tinygemm"), ("HALFMOON_SMALL_M_GEMM", "tinygemm_nopdl"),
                                       ("HALFMOON_SMALL_M_GEMM_ON", "o"), ("HALFMOON_FUSED_ROPE_STORE", "0"),
                                       ("HALFMOON_TUNED_GEMM", "cublaslt"), ("HALFMOON_TUNED_GEMM_ROWS", "2-16"),
                                       ("HALFMOON_TUNED_GEMM_CACHE", "/tmp/tuned.json"),
                                       ("HALFMOON_DECODE_GRAPH_BLAS", "cublas"),
                                       ("HALFMOON_DECODE_ATTN", "split_kv"),
                                       *[(n, "0" if n.endswith("CORES") else "fa2") for n in FLASHINFER_SWITCHES
                                         if n != "HALFMOON_FLASHINFER_EXTEND"],
                                       ("HALFMOON_FLASHINFER_EXTEND", "paged")])
def test_a_cpu_model_runner_refuses_a_gpu_switch_before_loading_anything(monkeypatch, var, value):
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner

    monkeypatch.setenv(var, value)
    # the model path does not exist: a ValueError naming the switch means nothing was loaded (the old
    # code accepted the switch, did nothing with it and failed only at the missing model)
    with pytest.raises(ValueError, match=var):
        ModelRunner(EngineConfig(model="/nonexistent/model", load_format="dummy"))


def test_the_tuned_gemm_needs_both_the_fused_ops_and_the_graphs(monkeypatch):
    monkeypatch.setenv("HALFMOON_TUNED_GEMM", "cublaslt")
    monkeypatch.setenv("HALFMOON_TUNED_GEMM_ROWS", "2-16")
    check_gpu_env(ALL_ON)
    with pytest.raises(ValueError, match="graphs off"):  # cuda_graph off: eager forwards keep F.linear
        check_gpu_env(GpuPaths(flashinfer_ops=True, graphs=False, flashinfer_attention=True))
    with pytest.raises(ValueError, match="fused ops off"):  # a float32 model on CUDA: TorchFusedOps
        check_gpu_env(GpuPaths(flashinfer_ops=False, graphs=True, flashinfer_attention=True))
    monkeypatch.setenv("HALFMOON_TUNED_GEMM", "off")
    with pytest.raises(ValueError, match="HALFMOON_TUNED_GEMM_ROWS has no effect while HALFMOON_TUNED_GEMM is off"):
        check_gpu_env(ALL_ON)


def test_small_m_switches_follow_their_mode(monkeypatch):
    monkeypatch.setenv("HALFMOON_SMALL_M_GEMM", "tinygemm")
    monkeypatch.setenv("HALFMOON_SMALL_M_GEMM_ON", "o,down")
    check_gpu_env(GpuPaths(flashinfer_ops=True, graphs=False, flashinfer_attention=True))  # eager too
    monkeypatch.setenv("HALFMOON_SMALL_M_GEMM", "cublas")
    with pytest.raises(ValueError, match="HALFMOON_SMALL_M_GEMM_ON has no effect: HALFMOON_SMALL_M_GEMM is 'cublas'"):
        check_gpu_env(ALL_ON)
    monkeypatch.setenv("HALFMOON_SMALL_M_GEMM", "auto")  # auto on a CPU engine is cublas: _ON is unused
    with pytest.raises(ValueError, match="HALFMOON_SMALL_M_GEMM_ON"):
        check_gpu_env(CPU)
    monkeypatch.delenv("HALFMOON_SMALL_M_GEMM_ON")
    check_gpu_env(CPU)  # auto itself is the default: fine anywhere


def test_a_bad_value_is_named_before_the_no_effect_check(monkeypatch):
    monkeypatch.setenv("HALFMOON_TUNED_GEMM_ROWS", "16-2")  # invalid and (tuned off) unused: invalid wins
    with pytest.raises(ValueError, match="expected 'lo-hi'"):
        check_gpu_env(CPU)


def test_a_tuned_gemm_cache_in_a_missing_folder_is_refused_at_start(monkeypatch, tmp_path):
    monkeypatch.setenv("HALFMOON_TUNED_GEMM", "cublaslt")
    monkeypatch.setenv("HALFMOON_TUNED_GEMM_CACHE", str(tmp_path / "no-such-dir" / "tuned.json"))
    with pytest.raises(ValueError, match="HALFMOON_TUNED_GEMM_CACHE=.*folder does not exist"):
        check_gpu_env(ALL_ON)
    monkeypatch.setenv("HALFMOON_TUNED_GEMM_CACHE", str(tmp_path / "tuned.json"))  # need not exist yet
    check_gpu_env(ALL_ON)


def test_empty_values_are_the_defaults_not_settings(monkeypatch):
    monkeypatch.setenv("HALFMOON_DECODE_GRAPH_BLAS", "")  # bench scripts pass "" for "the default"
    monkeypatch.setenv("HALFMOON_FLASHINFER_EXTEND", "")
    check_gpu_env(CPU)


def test_paths_mirror_the_model_runners_choices():
    fi = GpuPaths.of(torch.device("cpu"), torch.float32, True, True, "auto")
    assert fi == CPU
    assert GpuPaths.of(torch.device("cpu"), torch.bfloat16, True, True, "flashinfer").flashinfer_attention
    assert not GpuPaths.of(torch.device("cpu"), torch.bfloat16, True, True, "flashinfer").flashinfer_ops


def test_the_decode_attention_switch_needs_graphs_and_a_known_kernel(monkeypatch):
    monkeypatch.setenv("HALFMOON_DECODE_ATTN", "split_kv")
    check_gpu_env(ALL_ON)
    with pytest.raises(ValueError, match="HALFMOON_DECODE_ATTN picks the decode attention of CUDA-graph"):
        check_gpu_env(GpuPaths(flashinfer_ops=True, graphs=False, flashinfer_attention=True))
    monkeypatch.setenv("HALFMOON_DECODE_ATTN", "xqa")
    with pytest.raises(ValueError, match="HALFMOON_DECODE_ATTN='xqa': expected one of"):
        check_gpu_env(ALL_ON)


def test_the_decode_pdl_switch_needs_a_split_kv_graph_and_a_known_value(monkeypatch):
    from engine.cuda_graph_runner import decode_pdl

    assert decode_pdl("") is True and decode_pdl("1") is True and decode_pdl("0") is False  # on by default
    monkeypatch.delenv("HALFMOON_DECODE_PDL", raising=False)
    check_gpu_env(GpuPaths(flashinfer_ops=True, graphs=False, flashinfer_attention=True))  # the default: no error
    monkeypatch.setenv("HALFMOON_DECODE_PDL", "0")
    check_gpu_env(ALL_ON)
    with pytest.raises(ValueError, match="HALFMOON_DECODE_PDL launches the split-KV decode kernels"):
        check_gpu_env(GpuPaths(flashinfer_ops=True, graphs=False, flashinfer_attention=True))
    monkeypatch.setenv("HALFMOON_DECODE_ATTN", "flashinfer")
    with pytest.raises(ValueError, match="no bucket attends with the split-KV kernel"):
        check_gpu_env(ALL_ON)
    monkeypatch.setenv("HALFMOON_DECODE_ATTN", "")
    monkeypatch.setenv("HALFMOON_DECODE_PDL", "yes")
    with pytest.raises(ValueError, match="HALFMOON_DECODE_PDL='yes': expected 0 or 1"):
        check_gpu_env(ALL_ON)
