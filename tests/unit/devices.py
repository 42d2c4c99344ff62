"""The devices a pool-level unit test runs on: ``cpu`` always, ``cuda`` marked ``gpu`` (deselected by
the default ``-m 'not slow and not gpu'``; run with ``-m gpu``) and skipped with a reason where this
machine has no CUDA device."""

from __future__ import annotations

import pytest
import torch

CUDA = pytest.param("cuda", id="cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])
DEVICES = ["cpu", CUDA]
