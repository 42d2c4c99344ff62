"""``serve-prefill --kv-staging-mb`` (pd_common/staged_writes.py): a staging area that is not
positive, or below two pages of the rank's kv heads, stops the worker at start with one ``error:``
line naming the flag, no traceback (a real worker process, the default model)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.conftest import MODEL, model_available


def _prefill(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "halfmoon", "serve-prefill", "--model", MODEL, "--num-pages", "8",
                           "--registry", "127.0.0.1:1", "--metrics-port", "-1", *extra],
                          capture_output=True, text=True, timeout=300)


def test_a_bad_staging_size_is_one_error_naming_the_flag():
    if not model_available():
        pytest.skip("default model not pulled")
    zero = _prefill("--kv-staging-mb", "0")
    assert zero.returncode == 2 and "--kv-staging-mb" in zero.stderr, zero.stderr[-2000:]
    small = _prefill("--kv-staging-mb", "0.5")  # SmolLM2: a page of 3 kv heads is 720 KiB
    assert small.returncode == 1, small.stderr[-2000:]
    assert ("error: --kv-staging-mb 0.5: staging area of 524288 bytes is below two pages of 737280 bytes"
            in small.stderr + small.stdout)
    assert "Traceback" not in small.stderr
