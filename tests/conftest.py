"""Shared fixtures: the default model's HF directory, one torch thread per test process."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    import torch

    # 2 shared cores: more threads only contend (two 2-thread torch processes on 2 cores ran 5x
    # slower than with 1 thread each)
    torch.set_num_threads(1)
except ImportError:  # tests that do not need torch still run
    pass


@pytest.fixture(scope="session")
def model_dir():
    """HF directory of SmolLM2-135M-Instruct (fp32). Pulled by `make model`; skipped if absent."""
    from engine.model_store import DEFAULT_MODEL, ModelNotFoundError, resolve_model

    try:
        return resolve_model(DEFAULT_MODEL)
    except ModelNotFoundError as e:
        pytest.skip(f"default model not pulled: {e}")
