"""bench/gpu_tp.py without a GPU: it refuses in one line on a host with fewer than 2 CUDA devices,
and its floor is weights + KV over the ranks plus the step's collectives."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_tp import floor_ms
from engine.models.model_loader import resolve_model_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="a host with 2 GPUs runs the benchmark")
def test_refuses_in_one_line_below_two_gpus(tmp_path):
    out = tmp_path / "tp.json"
    p = subprocess.run([sys.executable, "-m", "bench.gpu_tp", "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        f"error: bench.gpu_tp needs 2 CUDA devices (TP=2); this host has {torch.cuda.device_count()}"]
    assert not out.exists()


def test_floor_halves_the_bytes_and_adds_the_collectives():
    cfg, _ = resolve_model_config("llama-3.1-8b", "dummy")
    one = floor_ms(cfg, 1, 32, 1024, 4e12, 10.0, 1e11)
    two = floor_ms(cfg, 2, 32, 1024, 4e12, 10.0, 1e11)
    assert one["collective_floor_ms"] == 0 and one["floor_ms"] == one["mem_floor_ms"]
    assert 15.0e9 < one["weight_bytes_per_gpu"] < 15.1e9  # 8B without the embedding, bf16
    assert one["kv_bytes_per_gpu"] == 32 * 1024 * 2 * 32 * 8 * 128 * 2
    assert two["mem_floor_ms"] == pytest.approx(one["mem_floor_ms"] / 2)
    # 2 all-reduces per layer + the embedding's (32 x 4096 bf16 each) + the lm_head gather (32 x vocab/2)
    want = 65 * (10e-3 + 32 * 4096 * 2 / 1e11 * 1e3) + 10e-3 + 32 * (128256 // 2) * 2 / 1e11 * 1e3
    assert two["collective_floor_ms"] == pytest.approx(want)
    assert two["floor_ms"] == pytest.approx(two["mem_floor_ms"] + want)
