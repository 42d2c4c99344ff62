"""`halfmoon generate --offline` streams a completion from the co-located engine; bad flags exit 2
with the field named."""

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


def test_offline_generate_bad_flag(model_dir):
    p = _run("hi", "--temperature", "-1")
    assert p.returncode == 2 and "temperature" in p.stderr
