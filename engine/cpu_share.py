"""CPU cores shared by co-located workers: a worker that is computing takes the cores the others
leave idle, and gives them back when they compute too (docs/architecture.md, CPU core sharing).

One small file (``halfmoon up`` creates it in its log dir, :meth:`CpuShare.create`) holds a record
per worker process: its pid, whether it is *busy* (has forwards to run) and the torch intra-op
threads it runs them with. A worker opens it (:meth:`CpuShare.open`, ``--cpu-share PATH``), which
claims a free record under an ``flock``, then calls :meth:`CpuShare.mark` between forwards, on its
scheduler thread: a busy worker sets its thread count to ``cores // (1 + other busy workers)``,
never below its own share (``--torch-threads``) nor above ``cores``; an idle one only says so.
Call it from the thread that runs the forwards: OpenMP's thread count is a per-thread setting.

Cores another process keeps busy are not idle, whatever the share file says: the router, a load
generator, other tenants of the box. :class:`OtherCpu` measures the cores every other process used
over the last ``window_s`` (``/proc/stat`` busy and steal time minus this process's CPU time), and
a worker takes a thread beyond its share only for a core that others left at least ``min_idle``
of idle (0: no such test, the share file alone decides): a 2-thread forward whose second thread
loses its core waits at every barrier and runs slower than on one thread.

So on 2 cores with one prefill worker P and one decode worker D (share 1 each), D decodes on both
cores while P has nothing to prefill and nothing else uses the second core, and on one while P
prefills; P prefills on both while D has nothing running. A worker that starts computing while
the other still runs a forward on every core overlaps it for the rest of that one forward. Thread count
changes only between forwards (``torch.set_num_threads``: about 0.5 us; greedy tokens and logits
are the same on 1 and 2 threads for the default model, measured with the packed oneDNN linears).

Layout (little endian): header ``magic[8] = b"HMCPUSH1", u32 cores, u32 records``; then per record
``i32 pid, u32 busy, u32 threads, u32 reserved``. A record whose pid is 0 or no longer alive is
free; a dead worker's busy flag is ignored. Aligned 4-byte stores, one writer per record.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"HMCPUSH1"
_HEADER = struct.Struct("<8sII")
_RECORD = struct.Struct("<iIII")
_BUSY = 4      # offsets inside a record
_THREADS = 8

# Where something else holds part of the second core steadily, a thread beyond the share pays only
# if that core is at least this idle. Measured on a 2-core box (B=8 ctx 640 decode step, 2 vs 1
# threads, a busy loop taking part of a core): others at 0.15 core 34.6 vs 41.6 ms, 0.3 core 36.0 vs
# 39.2, 0.5 core 40.5 vs 36.5; break-even ~0.4. The library's default (CpuShare); the workers' flags
# default to WORKER_MIN_IDLE below, measured in served runs.
STEADY_LOAD_MIN_IDLE = 0.6
# A worker's default (prefill and decode): no idle-core test. Served 1P1D runs on a 2-core Zen 4 box
# (router, benchmark client and the other worker beside it; bench.cpu_peer, 16 requests, 2
# interleaved reps): D at 0 vs 0.6 (3 runs) gave 1.02-1.12x the output tok/s on random and
# shared-prefix prompts at c=1 and c=8, 15 of 16 rep pairs ahead; then P at 0 vs 0.6 with D at 0 (2
# runs, variant order swapped) was ahead in 8 of 8 rep pairs at c=1 (random 1.01-1.11x, shared-prefix
# 1.04-1.07x, TTFT p50 equal or lower) and within noise at c=8 (random 0.98-0.99x, its TTFT p50
# favouring whichever stack ran first; shared-prefix 1.00-1.03x). The router's and client's use of
# the second core comes in short bursts per token, which a 2-thread forward absorbs better than the
# steady busy loop above.
WORKER_MIN_IDLE = 0.0


def _machine_busy_s() -> float | None:
    """CPU seconds every core of the machine spent busy (user, nice, system, irq, softirq, steal)
    since boot, or None where ``/proc/stat`` cannot be read."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()[1:9]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields)
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OtherCpu:
    """Cores the rest of the machine used lately: the machine's busy CPU seconds minus this
    process's, per wall second, over windows of at least ``window_s`` (the last full window's
    figure is kept in between). ``machine_busy_s`` / ``own_cpu_s`` / ``clock`` are injectable for
    tests; a machine without ``/proc/stat`` reads as 0 cores used."""

    def __init__(self, window_s: float = 0.2, machine_busy_s: Callable[[], float | None] = _machine_busy_s,
                 own_cpu_s: Callable[[], float] = time.process_time, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._machine, self._own, self._clock = machine_busy_s, own_cpu_s, clock
        self._last = (clock(), machine_busy_s(), own_cpu_s())
        self.cores_used = 0.0

    def update(self) -> float:
        """The latest figure (cores), after closing the window when ``window_s`` has passed."""
        now = self._clock()
        t0, m0, o0 = self._last
        if now - t0 >= self.window_s:
            m, o = self._machine(), self._own()
            if m is not None and m0 is not None:
                self.cores_used = max(0.0, ((m - m0) - (o - o0)) / (now - t0))
            self._last = (now, m, o)
        return self.cores_used


class CpuShareError(ValueError):
    """The share file is missing, not a share file, or has no free record (the message names it)."""


@dataclass(frozen=True)
class Record:
    """One worker's record as read: ``alive`` = pid is set and the process exists."""
    index: int
    pid: int
    busy: bool
    threads: int
    alive: bool


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


class CpuShare:
    """This process's record in a share file; see the module docstring.

    Args (via :meth:`open`):
        path: the share file.
        share: threads this worker runs with when every worker is busy (>= 1).
        apply: sets this process's intra-op threads (default ``torch.set_num_threads``).
        on_threads: called with the new count after each change (a metrics gauge).
    """

    def __init__(self, path: Path, mm: mmap.mmap, index: int, share: int,
                 apply: Callable[[int], None], on_threads: Callable[[int], None] | None,
                 other_cpu: OtherCpu | None = None, min_idle: float = STEADY_LOAD_MIN_IDLE):
        self.path = path
        self._mm = mm
        self.index = index
        self.cores, self.records = _HEADER.unpack_from(mm, 0)[1:]
        self.share = min(share, self.cores)
        self._apply = apply
        self._on_threads = on_threads
        self._busy = False
        self.other_cpu = other_cpu or OtherCpu()
        self.min_idle = min_idle
        # the count this process was started with; applied on the first busy mark, from the
        # thread that runs the forwards (OpenMP's thread count is per calling thread)
        self.threads = self.share
        self._applied = False
        struct.pack_into("<I", mm, self._offset(index) + _THREADS, self.share)
        if on_threads is not None:
            on_threads(self.share)

    # ------------------------------------------------------------------ file
    @staticmethod
    def create(path: str | os.PathLike, cores: int, records: int) -> Path:
        """Write an empty share file for ``records`` workers on ``cores`` cores (mode 0600).

        Raises:
            ValueError: ``cores`` or ``records`` < 1.
        """
        if cores < 1 or records < 1:
            raise ValueError(f"cpu share: cores and records must be >= 1, got {cores}, {records}")
        p = Path(path)
        data = _HEADER.pack(MAGIC, cores, records) + bytes(_RECORD.size * records)
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        return p

    @classmethod
    def open(cls, path: str | os.PathLike, share: int, apply: Callable[[int], None] | None = None,
             on_threads: Callable[[int], None] | None = None, other_cpu: OtherCpu | None = None,
             min_idle: float = STEADY_LOAD_MIN_IDLE) -> "CpuShare":
        """Claim a free record of the share file at ``path`` for this process (``other_cpu``,
        ``min_idle`` in [0, 1]: the idle-core test of the module docstring).

        Raises:
            CpuShareError: the file is missing or unreadable, not a share file, or every record
                belongs to a live process (the message names the path).
        """
        p = Path(path)
        if share < 1:
            raise CpuShareError(f"{p}: share must be >= 1 thread, got {share}")
        if not 0.0 <= min_idle <= 1.0:
            raise CpuShareError(f"{p}: min_idle must be in [0, 1], got {min_idle}")
        try:
            fd = os.open(p, os.O_RDWR)
        except OSError as e:
            raise CpuShareError(f"{p}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < _HEADER.size:
                raise CpuShareError(f"{p}: not a cpu share file ({size} bytes)")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, cores, records = _HEADER.unpack_from(mm, 0)
        if magic != MAGIC or cores < 1 or records < 1 or size != _HEADER.size + records * _RECORD.size:
            mm.close()
            raise CpuShareError(f"{p}: not a cpu share file (bad header or size)")
        index = cls._claim(p, mm, records)
        if apply is None:
            import torch

            apply = torch.set_num_threads
        return cls(p, mm, index, share, apply, on_threads, other_cpu, min_idle)

    @staticmethod
    def _claim(path: Path, mm: mmap.mmap, records: int) -> int:
        with open(path, "rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # claims of workers starting together serialize here
            for i in range(records):
                pid = _RECORD.unpack_from(mm, _HEADER.size + i * _RECORD.size)[0]
                if not _alive(pid):
                    _RECORD.pack_into(mm, _HEADER.size + i * _RECORD.size, os.getpid(), 0, 0, 0)
                    return i
        mm.close()
        raise CpuShareError(f"{path}: all {records} records belong to live processes")

    @staticmethod
    def read(path: str | os.PathLike) -> tuple[int, list[Record]]:
        """(cores, every record) of a share file, for tests and tools.

        Raises:
            CpuShareError: not a share file.
        """
        data = Path(path).read_bytes()
        if len(data) < _HEADER.size:
            raise CpuShareError(f"{path}: not a cpu share file")
        magic, cores, records = _HEADER.unpack_from(data, 0)
        if magic != MAGIC or len(data) != _HEADER.size + records * _RECORD.size:
            raise CpuShareError(f"{path}: not a cpu share file (bad header or size)")
        out = []
        for i in range(records):
            pid, busy, threads, _ = _RECORD.unpack_from(data, _HEADER.size + i * _RECORD.size)
            out.append(Record(i, pid, bool(busy), threads, _alive(pid)))
        return cores, out

    # ------------------------------------------------------------------ protocol
    def _offset(self, i: int) -> int:
        return _HEADER.size + i * _RECORD.size

    def others_busy(self) -> int:
        """Other live workers that said they are busy."""
        n = 0
        for i in range(self.records):
            if i == self.index:
                continue
            pid, busy = struct.unpack_from("<iI", self._mm, self._offset(i))
            if busy and _alive(pid):
                n += 1
        return n

    def mark(self, busy: bool) -> int:
        """Say whether this worker has forwards to run; when busy, take this moment's thread
        count. Call between forwards (scheduler thread). Returns the thread count in force."""
        if busy != self._busy:
            self._busy = busy
            struct.pack_into("<I", self._mm, self._offset(self.index) + _BUSY, int(busy))
        if busy:
            want = min(self.cores, self.cores // (1 + self.others_busy()))
            if want > self.share and self.min_idle > 0:  # only cores the rest of the machine leaves idle
                idle = self.cores - self.other_cpu.update()
                want = min(want, self.share + max(0, int(idle - self.share + 1 - self.min_idle)))
            self._set_threads(max(self.share, want))
        return self.threads

    def _set_threads(self, n: int) -> None:
        if n == self.threads and self._applied:
            return
        self._apply(n)
        self._applied = True
        self.threads = n
        struct.pack_into("<I", self._mm, self._offset(self.index) + _THREADS, n)
        if self._on_threads is not None:
            self._on_threads(n)

    def close(self) -> None:
        """Free this record (idle, no pid) and unmap the file."""
        if self._mm.closed:
            return
        _RECORD.pack_into(self._mm, self._offset(self.index), 0, 0, 0, 0)
        self._mm.close()


class NoCpuShare:
    """No co-located workers to share with (GPU, ``--tp`` > 1, a lone worker): ``mark`` does nothing."""

    threads = 0

    def mark(self, busy: bool) -> int:
        return self.threads

    def close(self) -> None:
        pass
