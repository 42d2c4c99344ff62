"""Launcher pieces that need no processes: thread budget and the port plan."""

from halfmoon.launcher import Stack, StackConfig, threads_per_worker


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
