"""Records and errors of the transfer engine: what callers see and what its layers hand each other.

Nothing here calls UCX. The UCP handles kept in these records (memh, rkey, ep) are plain integers
that only the progress thread passes to UCP.
"""

from __future__ import annotations

import bisect
import collections
import enum
from dataclasses import dataclass, field
from typing import Sequence, TypeVar

from protos import registry_pb2


class Op(enum.IntEnum):
    WRITE = 0  # local -> remote (put)
    READ = 1   # remote -> local (get)


class State(enum.Enum):
    PENDING = "PENDING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"


@dataclass(frozen=True)
class BatchStatus:
    """Status of one submitted batch. bytes_done: bytes known complete (all of them once COMPLETED;
    while PENDING, those whose puts UCX completed in place); reason: why it FAILED."""

    state: State
    bytes_done: int
    bytes_total: int
    reason: str = ""


@dataclass(frozen=True)
class Notify:
    sender: str      # segment name of the sending engine
    payload: bytes


class TransferError(RuntimeError):
    """Base class of the engine's errors."""


class SegmentClosed(TransferError):
    """The segment handle was dropped (peer failed, new incarnation, or closed): open it again."""


class DescriptorError(TransferError, ValueError):
    """A segment descriptor is malformed (empty address, bad rkey, overlapping regions, ...)."""


class BoundsError(TransferError, ValueError):
    """A transfer descriptor falls outside every registered (local) or published (remote) region."""


@dataclass
class Region:
    """A registered local memory region. base/length in bytes; location "cpu" or "cuda:N"."""

    base: int
    length: int
    location: str
    memh: int = 0     # ucp_mem_h
    rkey: bytes = b""  # packed remote key, published in the segment descriptor


@dataclass
class RemoteRegion:
    """One region of a peer's segment. base/length in bytes of the peer's address space."""

    base: int
    length: int
    rkey_buf: bytes  # packed rkey from the descriptor
    rkey: int = 0    # ucp_rkey_h, unpacked on the progress thread


_R = TypeVar("_R", Region, RemoteRegion)


def find_range(bases: Sequence[int], regions: Sequence[_R], addr: int, n: int) -> _R | None:
    """The region that holds all of [addr, addr + n) bytes, or None.

    regions: non-overlapping, sorted by base; bases[i] == regions[i].base."""
    i = bisect.bisect_right(bases, addr) - 1
    if i >= 0:
        r = regions[i]
        if addr + n <= r.base + r.length:
            return r
    return None


@dataclass
class Segment:
    """An opened remote segment (a peer's registered memory). Use it with submit / send_notify.

    The underscored fields belong to the engine's progress thread: endpoint, unpacked rkeys and the
    per-segment queues of batches still waiting to finish (`_pending`, in submission order) and of
    notifies waiting for them (`_notifies`)."""

    name: str
    incarnation: str
    descriptor: registry_pb2.SegmentDescriptor
    kv_layout: registry_pb2.KVLayout
    _regions: list[RemoteRegion] = field(default_factory=list, repr=False)
    _bases: list[int] = field(default_factory=list, repr=False)
    _ep: int = field(default=0, repr=False)  # ucp_ep_h, 0 once closed
    alive: bool = True
    failure: str = ""
    local_pid: int = 0          # owner's pid when it runs on this host (liveness check), else 0
    local_start: int = 0        # that process's start time, clock ticks (tells pid reuse apart)
    _pending: collections.deque = field(default_factory=collections.deque, repr=False)
    _notifies: collections.deque = field(default_factory=collections.deque, repr=False)

    def find(self, addr: int, n: int) -> RemoteRegion:
        """The published region holding [addr, addr + n); raises BoundsError if none does."""
        r = find_range(self._bases, self._regions, addr, n)
        if r is None:
            raise BoundsError(f"remote range [{addr:#x}, +{n}) is outside every region published "
                              f"by segment {self.name!r}")
        return r
