"""The CPU share file's protocol (engine/cpu_share.py): records claimed per process, a busy worker
takes the cores the others leave idle and gives them back when they are busy too, dead workers
do not count, bad files are refused by name. The real OpenMP thread change is checked on a thread
of its own (the count is per calling thread)."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest
import torch

from engine.cpu_share import CpuShare, CpuShareError, OtherCpu


class Threads:
    """Records every thread count a share applies."""

    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, n: int) -> None:
        self.calls.append(n)


class FixedCpu:
    """Other processes using ``cores_used`` cores."""

    def __init__(self, cores_used: float):
        self.cores_used = cores_used

    def update(self) -> float:
        return self.cores_used


def _open(path, share=1, other=0.0, min_idle=0.75):
    t = Threads()
    return CpuShare.open(path, share, apply=t, other_cpu=FixedCpu(other), min_idle=min_idle), t


def test_busy_worker_takes_idle_cores_and_gives_them_back(tmp_path):
    path = CpuShare.create(tmp_path / "share", cores=2, records=2)
    d, d_threads = _open(path)
    p, p_threads = _open(path)
    assert (d.index, p.index) == (0, 1)
    assert d.mark(True) == 2            # P idle: D takes both cores
    assert p.mark(True) == 1            # D busy: P gets its share
    assert d.mark(True) == 1            # P busy now: D gives one back
    p.mark(False)
    assert d.mark(True) == 2            # P idle again
    assert d_threads.calls == [2, 1, 2]
    assert p_threads.calls == [1]       # applied once, on its first busy mark
    d.mark(False)
    assert p.mark(True) == 2            # D idle: P prefills on both
    cores, recs = CpuShare.read(path)
    assert cores == 2 and [(r.busy, r.threads, r.alive) for r in recs] == [(False, 2, True), (True, 2, True)]
    gauge = []
    q = CpuShare.open(CpuShare.create(tmp_path / "three", cores=4, records=3), 1, apply=Threads(),
                      on_threads=gauge.append, min_idle=0)
    assert q.mark(True) == 4 and gauge == [1, 4]


@pytest.mark.parametrize("cores, others, min_idle, want", [
    (2, 0.1, 0.75, 2),    # the second core is idle
    (2, 0.3, 0.75, 1),    # the router or a client keeps part of it busy: stay on the share
    (2, 0.3, 0.5, 2),
    (2, 0.35, 0.6, 2),    # CpuShare's default: others up to 0.4 of the second core still leave it to us
    (2, 0.45, 0.6, 1),
    (2, 1.5, 0.0, 2),     # 0: the share file alone decides
    (8, 2.2, 0.75, 6),    # 5.8 cores idle: 6 threads (the last core 0.8 idle)
    (8, 9.0, 0.75, 1),    # busier than the machine (steal): never below the share
])
def test_threads_beyond_the_share_need_cores_others_leave_idle(tmp_path, cores, others, min_idle, want):
    path = CpuShare.create(tmp_path / "share", cores=cores, records=2)
    d, _ = _open(path, other=others, min_idle=min_idle)
    assert d.mark(True) == want


def test_other_cpu_is_the_machine_minus_this_process():
    clock, machine, own = [0.0], [100.0], [10.0]
    m = OtherCpu(window_s=0.2, machine_busy_s=lambda: machine[0], own_cpu_s=lambda: own[0], clock=lambda: clock[0])
    clock[0], machine[0], own[0] = 0.1, 100.2, 10.1
    assert m.update() == 0.0                      # window not over: last figure
    clock[0], machine[0], own[0] = 0.5, 100.8, 10.4
    assert m.update() == pytest.approx((0.8 - 0.4) / 0.5)
    clock[0], machine[0], own[0] = 1.0, 101.0, 10.9
    assert m.update() == 0.0                      # clamped: our own time counted on the machine later
    unreadable = OtherCpu(machine_busy_s=lambda: None, own_cpu_s=lambda: 0.0)
    time.sleep(0.25)
    assert unreadable.update() == 0.0
    real = OtherCpu(window_s=0.05)
    time.sleep(0.06)
    assert 0.0 <= real.update() <= (os.cpu_count() or 1) + 0.5


def test_share_is_a_floor_and_cores_a_ceiling(tmp_path):
    path = CpuShare.create(tmp_path / "share", cores=4, records=3)
    a, _ = _open(path, share=2)
    b, _ = _open(path)
    c, _ = _open(path)
    b.mark(True)
    c.mark(True)
    assert a.mark(True) == 2            # 4 // 3 busy = 1, but a's share is 2
    c.mark(False)
    assert b.mark(True) == 2            # 4 // 2
    big, _ = _open(CpuShare.create(tmp_path / "small", cores=2, records=1), share=8)
    assert big.mark(True) == 2          # never above the cores


def test_dead_workers_do_not_count_and_their_records_are_reused(tmp_path):
    path = CpuShare.create(tmp_path / "share", cores=2, records=2)
    a, _ = _open(path)
    b, _ = _open(path)
    with pytest.raises(CpuShareError, match="all 2 records belong to live processes"):
        _open(path)
    b.mark(True)
    assert a.mark(True) == 1
    # a record left busy by a process that died: a dead pid
    dead = subprocess.Popen(["true"])
    dead.wait()
    import mmap
    import struct
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        struct.pack_into("<iI", mm, 16 + 16 * b.index, dead.pid, 1)
    assert a.mark(True) == 2            # the dead worker's busy flag is ignored
    c, _ = _open(path)
    assert c.index == b.index           # and its record is free again
    a.close()
    assert not CpuShare.read(path)[1][0].alive


@pytest.mark.parametrize("content, why", [
    (None, "No such file"), (b"", "not a cpu share file"), (b"HMCPUSH1" + bytes(8), "bad header"),
    (b"NOTSHARE" + (2).to_bytes(4, "little") + (1).to_bytes(4, "little") + bytes(16), "bad header"),
    (b"HMCPUSH1" + (2).to_bytes(4, "little") + (3).to_bytes(4, "little") + bytes(16), "bad header or size"),
])
def test_bad_files_are_refused_naming_the_path(tmp_path, content, why):
    path = tmp_path / "share"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(CpuShareError, match=why) as e:
        _open(path)
    assert str(path) in str(e.value)


def test_bad_arguments():
    with pytest.raises(ValueError, match="cores and records"):
        CpuShare.create("/nonexistent/x", cores=0, records=1)
    with pytest.raises(CpuShareError, match="share must be >= 1"):
        CpuShare.open("/nonexistent/x", 0)
    with pytest.raises(CpuShareError, match=r"min_idle must be in \[0, 1\]"):
        CpuShare.open("/nonexistent/x", 1, min_idle=1.5)


def test_torch_threads_change_on_the_calling_thread(tmp_path):
    """With the default ``apply`` (torch.set_num_threads) the forward thread's count follows."""
    path = CpuShare.create(tmp_path / "share", cores=2, records=2)
    seen = {}

    def forward_thread():
        share = CpuShare.open(path, 1, min_idle=0)
        other = CpuShare.open(path, 1, apply=Threads())
        share.mark(True)
        seen["alone"] = torch.get_num_threads()
        other.mark(True)
        share.mark(True)
        seen["shared"] = torch.get_num_threads()
        share.close()
        other.close()

    t = threading.Thread(target=forward_thread)
    t.start()
    t.join()
    assert seen == {"alone": 2, "shared": 1}
