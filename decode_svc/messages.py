"""What D's scheduler says to prefill workers (``PrefillNet``) and what comes back to its inbox.

The scheduler thread never blocks on the network: ``PrefillNet`` calls return at once and their
outcomes come back later as ``DestResult`` / ``PeerGone`` messages; P's notices (sent after the
KV data, through the transfer engine) come back as ``Notice``. The messages both PD workers take
(``Submit``, ``Abort``, ``LoadQuery``, ``Wake``) are in ``pd_common.inbox``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from decode_svc.jobs import DestState
from protos import prefill_pb2


@dataclass(frozen=True)
class Notice:
    """A notice P sent after a room's KV data: ``payload`` is a serialized ``prefill_pb2.KVNotice``;
    ``sender`` is P's segment name."""

    sender: str
    payload: bytes


@dataclass(frozen=True)
class ProcessId:
    """P's processes as its segment descriptor names them: same-host proof of its death without
    the registry (``pid_start_ticks(pid) != start_ticks`` on ``host``, for rank 0 and every
    tensor-parallel follower, each of which posts its own puts). ``ranks``: the followers'
    (pid, start ticks); None when a follower's process is not named (its death cannot be proven)."""

    host: str
    pid: int
    start_ticks: int
    ranks: tuple[tuple[int, int], ...] | None = ()

    @classmethod
    def of(cls, desc) -> ProcessId | None:
        """From a ``registry_pb2.SegmentDescriptor``; None when it names no process."""
        if desc.pid <= 0:
            return None
        followers = [r for r in desc.regions if r.rank > 0]
        ranks = (None if any(r.pid <= 0 for r in followers)
                 else tuple((int(r.pid), int(r.pid_start_ticks)) for r in followers))
        return cls(desc.host_id, int(desc.pid), int(desc.pid_start_ticks), ranks)


@dataclass(frozen=True)
class DestResult:
    """How SetDestination for ``room`` ended: ACCEPTED (with P's segment, incarnation and, when the
    descriptor was at hand, its process), REJECTED or UNKNOWN (``error`` says why). A REJECTED or
    UNKNOWN outcome of a destination that went out pinned (``KVDestination.prefill_incarnation``)
    carries the start it was pinned to; otherwise no segment."""

    room: int
    state: DestState
    segment: str = ""
    incarnation: str = ""
    error: str = ""
    process: ProcessId | None = None


PEER_GONE_CAUSES = ("process_gone", "new_incarnation")


@dataclass(frozen=True)
class PeerGone:
    """Prefill segment ``segment`` is gone (``incarnation`` "": whatever incarnation it had).

    ``cause``: "process_gone" (its same-host process exited) or "new_incarnation" (the registry
    shows another start of it) prove that nothing of it writes any more; "absent" (no registry
    record: an expired lease, perhaps a stopped process) proves nothing, so waiting requests may
    fail fast but their pages stay quarantined."""

    segment: str
    incarnation: str
    cause: str = "process_gone"

    @property
    def proven(self) -> bool:
        return self.cause in PEER_GONE_CAUSES

    def matches(self, segment: str, incarnation: str) -> bool:
        """Whether a peer known as (segment, incarnation) is the one gone."""
        return segment == self.segment and (not self.incarnation or incarnation == self.incarnation)


class PrefillNet(Protocol):
    """D's calls toward prefill workers (``decode_svc.peers.PrefillPeers``); none of them blocks."""

    def set_destination(self, address: str, dest: prefill_pb2.KVDestination, request_id: str,
                        deadline: float | None = None, prefill_worker_id: str = "") -> None:
        """Send ``dest`` to P at ``address`` (gRPC host:port) with the RPC deadline ``deadline``
        (time.monotonic() seconds; not sent at all once it passed); the outcome comes back as
        DestResult. With ``prefill_worker_id`` (P's segment name, from the router) the destination
        is pinned to that worker's registered start, so a lost outcome still names who may write."""

    def abort(self, address: str, room: int, request_id: str, reason: str) -> None:
        """Ask P to drop the room (best effort; P still answers an accepted destination once)."""

    def check_alive(self, peers: set[tuple[str, str, ProcessId | None]]) -> None:
        """For each (segment, incarnation, process) that no longer lives, a PeerGone comes back."""
