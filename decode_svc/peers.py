"""D's network side toward prefill workers (``decode_svc.messages.PrefillNet``): SetDestination,
Abort and liveness checks, run on a small thread pool so the decode scheduler never blocks on the
network. Results go back to the scheduler as messages (``DecodeScheduler.post``).

SetDestination outcomes (``DestResult.state``): ACCEPTED (P will answer with exactly one notice),
REJECTED (P answered with a definite error, or the request provably never left D: P holds nothing
for the room, so D's pages are free to reuse), UNKNOWN (timeout, a connection lost after the
request may have gone out: P may or may not have it; D quarantines the pages).

Liveness (docs/architecture.md, Fencing one-sided writes): only proof counts. A same-host P whose
(pid, start ticks) no longer names a live process is gone, whatever the registry says; a registry
record with another incarnation means that start of P is gone. A missing record (an expired lease:
a stopped P looks exactly like that) is reported as "absent" and proves nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from decode_svc.jobs import DestState
from decode_svc.messages import DestResult, PeerGone, ProcessId
from protos import common_pb2, prefill_pb2_grpc
from security import OPEN, ClusterCredentials
from transfer_svc.liveness import host_id, pid_start_ticks

log = logging.getLogger("halfmoon.decode")

_AMBIGUOUS = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED}
# UNAVAILABLE details that mean no connection was ever made, so the request never went out
_NEVER_CONNECTED = ("failed to connect", "connection refused")
_AFTER_CONNECT = ("reset", "closed", "broken pipe", "eof", "goaway")


def destination_state(e: grpc.RpcError) -> DestState:
    """What a failed SetDestination says about P: REJECTED only when P answered a definite error
    or the connection was refused before anything was sent; otherwise UNKNOWN."""
    code = e.code()
    if code not in _AMBIGUOUS:
        return DestState.REJECTED
    details = (e.details() or "").lower()
    if (code == grpc.StatusCode.UNAVAILABLE and any(k in details for k in _NEVER_CONNECTED)
            and not any(k in details for k in _AFTER_CONNECT)):
        return DestState.REJECTED
    return DestState.UNKNOWN


def _exited(proc: ProcessId) -> bool:
    """Whether every process of ``proc`` (rank 0 and each follower; on this host) has exited; False
    while a follower is not named."""
    if proc.ranks is None:
        return False
    return all(pid_start_ticks(pid) != ticks for pid, ticks in ((proc.pid, proc.start_ticks), *proc.ranks))


def _other_start(e: grpc.RpcError) -> bool:
    """P refused a destination pinned to another start of itself (prefill_svc.server)."""
    return e.code() == grpc.StatusCode.FAILED_PRECONDITION and (e.details() or "").startswith("prefill_incarnation:")


class PrefillPeers:
    """gRPC stubs per prefill address + the registry for liveness.

    Args:
        post: callable(msg) delivering a ``DestResult`` or ``PeerGone`` to the scheduler.
        registry: ``transfer_svc.registry_client.RegistryClient`` (liveness), or None.
        rpc_timeout_s: deadline of SetDestination / Abort calls.
        credentials: this worker's cluster credentials, for its channels to P.
    """

    def __init__(self, post, registry=None, rpc_timeout_s: float = 10.0, credentials: ClusterCredentials = OPEN):
        self._post = post
        self._credentials = credentials
        self.registry = registry
        self.rpc_timeout_s = rpc_timeout_s
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="decode-net")
        self._stubs: dict[str, prefill_pb2_grpc.PrefillStub] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._checking = False

    def _stub(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                ch = self._credentials.channel(address)
                self._channels[address] = ch
                stub = self._stubs[address] = prefill_pb2_grpc.PrefillStub(ch)
            return stub

    def set_destination(self, address: str, dest, request_id: str, deadline: float | None = None,
                        prefill_worker_id: str = "") -> None:
        def call():
            room = int(dest.room)
            start = self._registered_start(prefill_worker_id)
            for attempt in range(2):
                seg, inc, proc = (prefill_worker_id, *start) if start else ("", "", None)
                dest.prefill_incarnation = inc
                timeout = self.rpc_timeout_s if deadline is None else deadline - time.monotonic()
                if timeout <= 0:  # never sent: P cannot hold it
                    self._post(DestResult(room, DestState.REJECTED, error="not sent: its deadline passed first"))
                    return
                try:
                    resp = self._stub(address).SetDestination(dest, timeout=timeout)
                except grpc.RpcError as e:
                    if attempt == 0 and start and _other_start(e):  # our descriptor was stale: once more
                        start = self._registered_start(prefill_worker_id, refresh=True)
                        continue
                    self._post(DestResult(room, destination_state(e), seg, inc,
                                          error=f"{e.code().name}: {e.details()}", process=proc))
                    return
                except Exception as e:  # never lose the outcome
                    self._post(DestResult(room, DestState.UNKNOWN, seg, inc, error=repr(e), process=proc))
                    return
                if not (inc and resp.incarnation == inc):  # the pinned start's process is already at hand
                    proc = self._process(resp.prefill_segment, resp.incarnation)
                self._post(DestResult(room, DestState.ACCEPTED, resp.prefill_segment, resp.incarnation,
                                      process=proc))
                return

        self._pool.submit(call)

    def _registered_start(self, worker_id: str, refresh: bool = False) -> tuple[str, ProcessId | None] | None:
        """(incarnation, process) of prefill worker ``worker_id``'s registered start, from its
        descriptor (cached unless ``refresh``); None without a worker id, a registry or a record.
        The process is None when the descriptor names none."""
        if self.registry is None or not worker_id:
            return None
        try:
            desc = self.registry.get_segment(worker_id, refresh=refresh)
        except Exception:  # no record, or no registry now: the destination goes out unpinned
            return None
        if not desc.incarnation:
            return None
        return desc.incarnation, ProcessId.of(desc)

    def _process(self, segment: str, incarnation: str) -> ProcessId | None:
        """P's process from its descriptor (cached by the registry client), kept with the pages
        so that P's death can be proven on this host even once its registry record is gone."""
        start = self._registered_start(segment)
        if start is None or start[0] != incarnation:
            start = self._registered_start(segment, refresh=True)
        return start[1] if start is not None and start[0] == incarnation else None

    def abort(self, address: str, room: int, request_id: str, reason: str) -> None:
        def call():
            try:
                self._stub(address).Abort(common_pb2.AbortRequest(request_id=request_id, room=room,
                                                                  reason=reason),
                                          timeout=self.rpc_timeout_s)
            except grpc.RpcError as e:
                log.info("abort of room %d on %s failed: %s", room, address, e.code().name)

        self._pool.submit(call)

    def check_alive(self, peers: set[tuple[str, str, ProcessId | None]]) -> None:
        """For each (segment, incarnation, process): post ``PeerGone`` with cause "process_gone"
        (its same-host process exited), "new_incarnation" (the registry has another start of it) or
        "absent" (no registry record: proves nothing)."""
        if self._checking:
            return
        self._checking = True

        def call():
            try:
                for seg, inc, proc in peers:
                    cause = self._gone(seg, inc, proc)
                    if cause:
                        self._post(PeerGone(seg, inc, cause))
            except Exception:
                log.exception("liveness check")
            finally:
                self._checking = False

        self._pool.submit(call)

    def _gone(self, seg: str, inc: str, proc: ProcessId | None) -> str:
        me = host_id()
        if proc is not None and proc.host == me and proc.ranks is not None:
            return "process_gone" if _exited(proc) else ""
        if self.registry is None:
            return ""
        try:
            desc = self.registry.get_segment(seg, refresh=True)
        except KeyError:
            return "absent"
        except grpc.RpcError:
            return ""  # registry unreachable: decide nothing
        if inc and desc.incarnation != inc:
            return "new_incarnation"
        proc = ProcessId.of(desc)
        if inc and proc is not None and proc.host == me and _exited(proc):
            return "process_gone"
        return ""

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for ch in self._channels.values():
                ch.close()
