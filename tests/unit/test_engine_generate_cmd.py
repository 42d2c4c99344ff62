"""`halfmoon generate --offline` streams a completion from the co-located engine (one subprocess;
bad input is covered at the engine level in test_engine_scheduler.py)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from engine.config import EngineConfig
from engine.engine_args import add_engine_arguments, engine_config_from_args

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(*args):
    return subprocess.run([sys.executable, "-m", "halfmoon", "generate", "--offline", *args, "--torch-threads", "1",
                           "--num-pages", "64"], capture_output=True, text=True, timeout=300, env=ENV)


def test_offline_generate(model_dir):
    p = _run("--chat", "What is the capital of France?", "--max-tokens", "12")
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout
    assert "completion" in p.stderr


def test_remote_generate_out_of_range_flag_is_exit_2():
    """An int past the proto field (int32 --max-tokens, uint64 --seed) is rejected before connecting
    (no router listens on port 1): exit 2 with an error line, no traceback."""
    for flags in (["--max-tokens", str(2**40)], ["--seed", "-1"]):
        p = subprocess.run([sys.executable, "-m", "halfmoon", "generate", "hi", "--router", "127.0.0.1:1", *flags],
                           capture_output=True, text=True, timeout=120, env=ENV)
        assert p.returncode == 2, p.stderr
        assert "INVALID_ARGUMENT" in p.stderr and "Traceback" not in p.stderr


def test_offline_generate_bad_device_is_one_error_line():
    """`--device gpu1` is an argparse error (exit 2); `--device cuda:99` (no such GPU here, or a
    CPU-only torch) is one `error: --device` line before any model loads: no torch traceback."""
    p = _run("hi", "--device", "gpu1")
    assert p.returncode == 2 and "argument --device: 'gpu1' is not cpu, cuda or cuda:N" in p.stderr, p.stderr
    p = _run("hi", "--device", "cuda:99")
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert "error: --device cuda:99:" in p.stderr, p.stderr


def test_offline_max_context_above_the_window_is_one_error_line():
    """`--max-context` above SmolLM2's 8192-token window: exit 2 with one error line, no traceback."""
    p = _run("hi", "--load-format", "dummy", "--model", "smollm2-135m", "--max-context", "9000")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "error: --max-context 9000 is above the model's context window of 8192 tokens" in p.stderr


def test_kv_pool_flag_is_kv_memory_mb(capsys):
    """One pool flag on every command: ``--kv-memory-mb`` (MiB). The old ``--kv-memory`` of this
    command is an error that names it; unset, the engine's default budget applies."""
    parser = argparse.ArgumentParser(prog="halfmoon generate")
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args(["--kv-memory-mb", "64"])).kv_memory == 64 << 20
    assert engine_config_from_args(parser.parse_args([])).kv_memory == EngineConfig().kv_memory
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--kv-memory", "2GiB"])
    assert e.value.code == 2
    assert "--kv-memory is now --kv-memory-mb" in capsys.readouterr().err
    assert "--kv-memory " not in parser.format_help()  # one documented flag


def test_max_retractions_flag(capsys):
    """``--max-retractions`` reaches EngineConfig (the co-located scheduler's pin limit); a negative
    value is an argparse error naming the flag."""
    parser = argparse.ArgumentParser(prog="halfmoon generate")
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args(["--max-retractions", "5"])).max_retractions == 5
    assert engine_config_from_args(parser.parse_args([])).max_retractions == EngineConfig().max_retractions == 3
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--max-retractions", "-1"])
    assert e.value.code == 2 and "argument --max-retractions: -1 is negative" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [(["--tp", "0"], "argument --tp: expected >= 1, got 0"),
                                          (["--tp-timeout", "0"], "argument --tp-timeout: '0' is not > 0")])
def test_tp_flags(capsys, argv, message):
    """``--tp`` / ``--tp-timeout`` reach EngineConfig (tensor parallelism); out-of-range values are
    argparse errors naming the flag."""
    parser = argparse.ArgumentParser(prog="halfmoon generate")
    add_engine_arguments(parser)
    cfg = engine_config_from_args(parser.parse_args(["--tp", "3", "--tp-timeout", "12.5"]))
    assert (cfg.tp_size, cfg.tp_timeout_s) == (3, 12.5)
    assert engine_config_from_args(parser.parse_args([])).tp_size == 1
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
