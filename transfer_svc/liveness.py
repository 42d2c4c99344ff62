"""Is a segment's owner process still alive? Host identity and process start times from /proc.

Shared-memory (cma) writes into a process that died report success, so UCX alone cannot tell a
write into a dead peer on this host from a good one. A descriptor therefore carries its owner's
host id, pid and process start time; an engine on the same host checks that (pid, start time)
still names a live process: when a segment is opened, when a handle is reused, and after every
batch to it completes. The start time tells a reused pid apart from the original process.
"""

from __future__ import annotations

import os

from protos import registry_pb2
from transfer_svc.types import Segment


def host_id() -> str:
    """"<hostname>/<kernel boot id>": equal for two processes on one (booted) host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{os.uname().nodename}/{boot}"


def pid_start_ticks(pid: int) -> int | None:
    """starttime of a live process from /proc/<pid>/stat (clock ticks), None if it is gone or a
    zombie (a process killed but not yet reaped no longer has its memory)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rindex(b")") + 2:].split()
    if rest[0] in (b"Z", b"X"):
        return None
    return int(rest[19])


def local_owner(desc: registry_pb2.SegmentDescriptor, host: str) -> tuple[int, int]:
    """(pid, start ticks) of the descriptor's owner when it runs on `host` (a host_id()), else
    (0, 0): only an owner on this host can be checked through /proc."""
    if desc.host_id == host and desc.pid > 0:
        return desc.pid, desc.pid_start_ticks
    return 0, 0


def owner_exited(seg: Segment) -> bool:
    """True when `seg`'s owner runs on this host and (pid, start time) no longer names a live
    process; False when it is alive or runs elsewhere (then only UCX errors and timeouts tell)."""
    return bool(seg.local_pid) and pid_start_ticks(seg.local_pid) != seg.local_start
