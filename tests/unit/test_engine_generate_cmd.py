"""`halfmoon generate --offline` streams a completion from the co-located engine (one subprocess;
bad input is covered at the engine level in test_engine_scheduler.py)."""

from __future__ import annotations

import os
import subprocess
import sys

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(*args):
    return subprocess.run([sys.executable, "-m", "halfmoon", "generate", "--offline", *args, "--torch-threads", "1",
                           "--num-pages", "64"], capture_output=True, text=True, timeout=300, env=ENV)


def test_offline_generate(model_dir):
    p = _run("--chat", "What is the capital of France?", "--max-tokens", "12")
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout
    assert "completion" in p.stderr
