"""The CPU share file's protocol (engine/cpu_share.py): records claimed per process, a busy worker
takes the cores the others leave idle and gives them back when they are busy too, dead workers
do not count, bad files are refused by name. The real OpenMP thread change is checked on a thread
of its own (the count is per calling thread)."""

from __future__ import annotations

import subprocess
import threading

import pytest
import torch

from engine.cpu_share import CpuShare, CpuShareError


class Threads:
    """Records every thread count a share applies."""

    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, n: int) -> None:
        self.calls.append(n)


def _open(path, share=1):
    t = Threads()
    return CpuShare.open(path, share, apply=t), t


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
                      on_threads=gauge.append)
    assert q.mark(True) == 4 and gauge == [1, 4]


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


def test_torch_threads_change_on_the_calling_thread(tmp_path):
    """With the default ``apply`` (torch.set_num_threads) the forward thread's count follows."""
    path = CpuShare.create(tmp_path / "share", cores=2, records=2)
    seen = {}

    def forward_thread():
        share = CpuShare.open(path, 1)
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
