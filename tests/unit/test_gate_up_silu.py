"""The fused gate/up GEMM + SiLU·mul kernel (``engine.gate_up_silu``) in Triton's CPU interpreter:
runs ``gate_up_silu_cases.py`` in a fresh process with ``TRITON_INTERPRET=1`` (see its docstring)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_interpreted_cases_pass():
    cases = Path(__file__).with_name("gate_up_silu_cases.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
                       env=env, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "7 passed" in r.stdout, r.stdout[-2000:]  # every case ran: none skipped or deselected
