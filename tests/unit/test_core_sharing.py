"""When ``halfmoon up`` makes a share file for its workers, and the OpenMP environment it gives
them (halfmoon/core_sharing.py)."""

from __future__ import annotations

import pytest

from engine.cpu_share import CpuShare
from halfmoon.core_sharing import SPIN_COUNT, share_file, worker_env
from halfmoon.launcher import add_arguments, config_from_args
from halfmoon.stack_config import StackConfig
from halfmoon.worker_plan import plan_workers


@pytest.mark.parametrize("kw, cores, shared", [
    (dict(cpu_share=True), 2, True),                     # 1P1D on 2 cores: one thread each, shared
    (dict(cpu_share=True, prefill=2, decode=2), 8, True),
    (dict(), 2, False),                                  # off by default
    (dict(cpu_share=True, decode_device="cuda:0"), 2, False),
    (dict(cpu_share=True, decode_tp=2), 4, False),
    (dict(cpu_share=True, torch_threads=2), 2, False),   # every worker already has every core
    (dict(cpu_share=True), 1, False),                    # one core: nothing to share
])
def test_share_file_only_for_co_located_single_rank_cpu_workers(tmp_path, kw, cores, shared):
    cfg = StackConfig(**kw)
    plan = plan_workers(cfg, cores)
    path = share_file(cfg, plan, tmp_path, cores)
    assert (path is not None) == shared
    if shared:
        got_cores, records = CpuShare.read(path)
        assert got_cores == cores and len(records) == len(plan) and not any(r.alive for r in records)


def test_worker_env_short_spin_on_cpu_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    cfg = StackConfig(cpu_share=True, decode_device="cuda:0")
    p, d = plan_workers(cfg, 2)
    assert worker_env(cfg, p) == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GOMP_SPINCOUNT": SPIN_COUNT}
    assert "GOMP_SPINCOUNT" not in worker_env(cfg, d)  # a GPU worker
    off = StackConfig(cpu_share=False)
    assert "GOMP_SPINCOUNT" not in worker_env(off, plan_workers(off, 2)[0])
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert "GOMP_SPINCOUNT" not in worker_env(cfg, p)


def test_up_flag():
    import argparse

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert config_from_args(ap.parse_args([])).cpu_share is True  # the default since the small-M GEMM kernel
    assert config_from_args(ap.parse_args(["--cpu-share", "off"])).cpu_share is False
    with pytest.raises(SystemExit):
        ap.parse_args(["--cpu-share", "maybe"])


def test_min_idle_flag_is_a_share_of_a_core():
    import argparse

    from pd_common.worker_runtime import add_common_arguments

    for role, default in (("prefill", 0.0), ("decode", 0.0)):  # no idle-core test by default
        ap = argparse.ArgumentParser()
        add_common_arguments(ap, role)  # each worker role's own parser
        assert ap.parse_args([]).cpu_share_min_idle == default, role
        assert ap.parse_args(["--cpu-share-min-idle", "0.3"]).cpu_share_min_idle == 0.3
        for bad in ("1.5", "-0.1", "x"):
            with pytest.raises(SystemExit):
                ap.parse_args(["--cpu-share-min-idle", bad])
