"""Launcher pieces that need no processes: thread budget, the port plan, per-role devices."""

import argparse

import pytest

from halfmoon.launcher import Stack, StackConfig, add_arguments, config_from_args
from halfmoon.stack_config import threads_per_worker


def test_threads_per_worker():
    assert threads_per_worker(2, cores=2) == 1
    assert threads_per_worker(4, cores=2) == 1     # more workers than cores: one thread each
    assert threads_per_worker(2, cores=16) == 8
    assert threads_per_worker(3, cores=16) == 5
    assert threads_per_worker(1) >= 1


def test_port_plan(tmp_path):
    st = Stack(StackConfig(base_port=50050, log_dir=str(tmp_path)))
    assert [st._port(i) for i in (0, 1, 2, 3, 4, 10, 11)] == [50050, 50051, 50052, 50053, 50054, 50060, 50061]
    st0 = Stack(StackConfig(base_port=0, log_dir=str(tmp_path)))
    assert {st0._port(i) for i in range(20)} == {0}  # every process picks a free port


def test_per_role_devices_and_dtype():
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--decode", "3", "--prefill-device", "cuda:0",
                                         "--decode-device", "cuda:1,cuda:2", "--dtype", "bfloat16",
                                         "--load-format", "dummy"]))
    assert [cfg.device_of("prefill", 0)] == ["cuda:0"]
    assert [cfg.device_of("decode", i) for i in range(3)] == ["cuda:1", "cuda:2", "cuda:1"]
    assert (cfg.dtype, cfg.load_format) == ("bfloat16", "dummy")
    default = config_from_args(p.parse_args([]))
    assert (default.device_of("prefill", 0), default.device_of("decode", 0), default.dtype) == ("cpu", "cpu", "float32")
    with pytest.raises(SystemExit, match="--decode-device: 'gpu1'"):
        config_from_args(p.parse_args(["--decode-device", "cuda:1,gpu1"]))


def test_up_defaults_to_kv_events_with_local_prefill_and_per_role_when_asked():
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args([]))
    assert cfg.policy == "kv_events" and cfg.router_args == ["--local-prefill-max-tokens", "256"]
    cfg = config_from_args(p.parse_args(["--local-prefill-max-tokens", "0"]))
    assert cfg.policy == "kv_events" and cfg.router_args == []
    cfg = config_from_args(p.parse_args(["--decode-policy", "round_robin"]))  # a per-role flag picks per_role
    assert (cfg.policy, cfg.decode_policy, cfg.router_args) == ("per_role", "round_robin", [])
    with pytest.raises(SystemExit, match="pass up's own --local-prefill-max-tokens"):
        config_from_args(p.parse_args(["--router-args=--local-prefill-max-tokens=64"]))
    with pytest.raises(SystemExit, match="--local-prefill-max-tokens must be >= 0"):
        config_from_args(p.parse_args(["--local-prefill-max-tokens", "-1"]))
    with pytest.raises(SystemExit, match="--local-prefill-max-tokens needs --policy kv_events"):
        config_from_args(p.parse_args(["--policy", "per_role", "--local-prefill-max-tokens", "64"]))
    with pytest.raises(SystemExit, match="are for --policy per_role"):
        config_from_args(p.parse_args(["--policy", "kv_events", "--prefill-policy", "round_robin"]))


def test_role_args_reach_only_their_role_and_parse():
    from decode_svc.main import add_arguments as decode_arguments
    from prefill_svc.main import add_arguments as prefill_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--decode-args", "--overlap-schedule off",
                                         "--prefill-args", "--chunked-prefill-size 1024"]))
    assert cfg.role_args == {"prefill": ["--chunked-prefill-size", "1024"], "decode": ["--overlap-schedule", "off"]}
    dp, pp = argparse.ArgumentParser(), argparse.ArgumentParser()
    decode_arguments(dp)
    prefill_arguments(pp)
    assert dp.parse_args(cfg.role_args["decode"]).overlap_schedule == "off"
    assert pp.parse_args(cfg.role_args["prefill"]).chunked_prefill_size == 1024
    with pytest.raises(SystemExit):  # a decode-only flag is not a prefill flag
        pp.parse_args(cfg.role_args["decode"])


@pytest.mark.parametrize("flag,value,says", [
    ("--decode-args", "--kv-layout bogus", "--decode-args: argument --kv-layout: invalid choice: 'bogus'"),
    ("--decode-args", "--overlap-schedule maybe", "argument --overlap-schedule: invalid choice"),
    ("--decode-args", "--no-such-flag", "--decode-args: unrecognized arguments: --no-such-flag"),
    ("--decode-args", "--device gpu1", "argument --device: 'gpu1' is not cpu, cuda or cuda:N"),
    ("--prefill-args", "--overlap-schedule on", "--prefill-args: unrecognized arguments: --overlap-schedule"),
    ("--prefill-args", "--page-size '16", "--prefill-args: No closing quotation"),
])
def test_bad_role_args_stop_up_before_anything_starts(flag, value, says):
    """A typo in --prefill-args/--decode-args is one line naming the flag from config_from_args (no
    process started), not a worker's usage dump after the registry started, nor a shlex traceback."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(SystemExit) as e:
        config_from_args(p.parse_args([f"{flag}={value}"]))  # "=": a lone flag is no value to argparse
    assert says in str(e.value) and "\n" not in str(e.value)


def test_worker_with_an_unusable_cuda_device_says_so_in_one_line():
    """`serve-decode --device cuda:99` (no such GPU here, or a CPU-only torch) exits with an `error:
    --device` line before loading anything, not a torch traceback from set_device."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "halfmoon", "serve-decode", "--device", "cuda:99",
                        "--metrics-port", "-1"], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "error: --device cuda:99:" in r.stderr, r.stderr


def test_max_context_reaches_the_router_and_every_worker(tmp_path):
    """``up --max-context N``: one cap for the router and both worker roles (their own parsers take it)."""
    from decode_svc.main import add_arguments as decode_arguments
    from router_svc.main import add_arguments as router_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--max-context", "1024"]))
    from halfmoon.worker_plan import context_args, plan_workers, worker_argv

    sc = StackConfig(max_context=cfg.max_context, log_dir=str(tmp_path))
    argv = context_args(sc)
    assert argv == ["--max-context", "1024"]
    for w in plan_workers(sc, cores=2):  # every worker's command line carries it
        wargv = worker_argv(sc, w, (1, 2), "127.0.0.1:3", [])
        assert wargv[wargv.index("--max-context") + 1] == "1024", w
    for add in (decode_arguments, router_arguments):
        rp = argparse.ArgumentParser()
        add(rp)
        assert rp.parse_args(argv).max_context == 1024
    assert context_args(StackConfig(log_dir=str(tmp_path))) == []  # unset: each takes the model's
    with pytest.raises(SystemExit, match="--max-context must be > 0, got 0"):
        config_from_args(p.parse_args(["--max-context", "0"]))
