"""``halfmoon up --prefill-tp / --decode-tp`` (halfmoon/worker_plan.py): the planned worker argv
carries each role's ``--tp``, and the torch threads are split over every rank, not every worker."""

from __future__ import annotations

import argparse

import pytest

from decode_svc.main import add_arguments as decode_arguments
from halfmoon.launcher import add_arguments, config_from_args
from halfmoon.worker_plan import plan_workers, worker_argv


def up(*argv: str):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(list(argv)))


def test_planned_argv_carries_each_roles_tp_and_the_role_args_after_it():
    cfg = up("--prefill", "1", "--decode", "2", "--prefill-tp", "2", "--decode-tp", "3",
             "--decode-args", "--overlap-schedule on")
    plan = plan_workers(cfg, cores=16)
    assert [(w.worker_id, w.k, w.tp) for w in plan] == [("prefill-0", 0, 2), ("decode-0", 1, 3), ("decode-1", 2, 3)]
    assert {w.threads for w in plan} == {2}  # 16 cores over 2 + 3 + 3 = 8 ranks, not over 3 workers
    argv = worker_argv(cfg, plan[1], (50062, 50063), "127.0.0.1:50053", ["--cluster-token-file", "t"])
    assert argv[0] == "serve-decode" and argv[-2:] == ["--overlap-schedule", "on"]
    dp = argparse.ArgumentParser()
    decode_arguments(dp)
    got = dp.parse_args(argv[1:])  # the decode worker's own parser reads what up would start
    assert (got.tp, got.torch_threads, got.port, got.metrics_port, got.worker_id, got.overlap_schedule) == \
        (3, 2, 50062, 50063, "decode-0", "on")


def test_default_is_one_rank_per_worker_and_threads_split_over_workers():
    plan = plan_workers(up(), cores=8)
    assert [(w.tp, w.threads) for w in plan] == [(1, 4), (1, 4)]
    assert plan_workers(up("--decode-tp", "4"), cores=2)[1].threads == 1  # more ranks than cores: one each
    assert {w.threads for w in plan_workers(up("--decode-tp", "2", "--torch-threads", "3"), cores=8)} == {3}


@pytest.mark.parametrize("argv, says", [
    (["--decode-args", "--tp 2"], "--decode-args: pass --decode-tp instead of --tp"),
    (["--prefill-args=--tp=2"], "--prefill-args: pass --prefill-tp instead of --tp"),
], ids=["decode-args", "prefill-args-eq"])
def test_tp_inside_role_args_is_refused_naming_the_flag(argv, says):
    with pytest.raises(SystemExit, match=says):
        up(*argv)


def test_tp_below_one_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        up("--prefill-tp", "0")
    assert "--prefill-tp" in capsys.readouterr().err
