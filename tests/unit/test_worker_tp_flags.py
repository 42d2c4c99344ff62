"""``--tp`` on P and D workers (pd_common/worker_runtime.py): the flags reach the engine config, and
flags a tensor-parallel worker cannot honour stop it with one ``error:`` line before anything loads."""

from __future__ import annotations

import argparse

import pytest

from pd_common.tp_flags import check_tp_flags
from pd_common.worker_runtime import Worker, add_common_arguments, engine_config


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_common_arguments(p, "prefill")
    return p.parse_args(list(argv))


def test_tp_flags_reach_the_engine_config():
    cfg = engine_config(parse("--tp", "3", "--tp-timeout", "7"), rows=4)
    assert (cfg.tp_size, cfg.tp_timeout_s) == (3, 7.0)
    assert engine_config(parse(), rows=4).tp_size == 1


@pytest.mark.parametrize("flags, message", [
    (["--kv-layout", "layer_major"], "--tp > 1 needs --kv-layout page_major"),
], ids=["layer-major"])
def test_flags_tp_cannot_honour_stop_the_worker_before_it_loads(flags, message):
    with pytest.raises(SystemExit, match=f"^error: {message}"):
        Worker(parse("--tp", "2", *flags), "prefill")
    Worker(parse("--tp", "1", *flags), "prefill")  # one rank: fine


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_tp_the_models_heads_cannot_split_stops_the_worker_with_one_line(role):
    # the default model's 3 kv heads on 4 ranks: was a traceback from the model load (up --prefill-tp 4)
    with pytest.raises(SystemExit, match=r"^error: --tp 4: 4 ranks cannot share the model's 3 kv heads"):
        Worker(parse("--tp", "4", "--model", "smollm2-135m", "--load-format", "dummy"), role)
    Worker(parse("--tp", "3", "--model", "smollm2-135m", "--load-format", "dummy"), role)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_kv_checksums_run_with_tensor_parallelism(role):
    # checksums are per (page, kv head), so they no longer depend on how a worker splits its heads
    assert check_tp_flags(parse("--tp", "2", "--kv-checksums")) is None
    Worker(parse("--tp", "3", "--kv-checksums"), role)


def test_tp_below_one_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse("--tp", "0")
    assert "--tp" in capsys.readouterr().err
