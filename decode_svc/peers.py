"""D's network side toward prefill workers (``decode_svc.messages.PrefillNet``): SetDestination,
Abort and liveness checks, run on a small thread pool so the decode scheduler never blocks on the
network. Results go back to the scheduler as messages (``DecodeScheduler.post``).

SetDestination outcomes (``DestResult.state``): ACCEPTED (P will answer with exactly one notice),
REJECTED (P answered with a definite error: it holds nothing for the room, so D's pages are free to
reuse), UNKNOWN (timeout / unreachable: P may or may not have it; D quarantines the pages).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from decode_svc.jobs import DestState
from decode_svc.messages import DestResult, PeerGone
from protos import common_pb2, prefill_pb2_grpc

log = logging.getLogger("halfmoon.decode")

_AMBIGUOUS = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED}


class PrefillPeers:
    """gRPC stubs per prefill address + the registry for liveness.

    Args:
        post: callable(msg) delivering a ``DestResult`` or ``PeerGone`` to the scheduler.
        registry: ``transfer_svc.registry_client.RegistryClient`` (liveness), or None.
        rpc_timeout_s: deadline of SetDestination / Abort calls.
    """

    def __init__(self, post, registry=None, rpc_timeout_s: float = 10.0):
        self._post = post
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
                ch = grpc.insecure_channel(address)
                self._channels[address] = ch
                stub = self._stubs[address] = prefill_pb2_grpc.PrefillStub(ch)
            return stub

    def set_destination(self, address: str, dest, request_id: str) -> None:
        def call():
            room = int(dest.room)
            try:
                resp = self._stub(address).SetDestination(dest, timeout=self.rpc_timeout_s)
                self._post(DestResult(room, DestState.ACCEPTED, resp.prefill_segment, resp.incarnation))
            except grpc.RpcError as e:
                state = DestState.UNKNOWN if e.code() in _AMBIGUOUS else DestState.REJECTED
                details = (e.details() or "").lower()
                if e.code() == grpc.StatusCode.UNAVAILABLE and ("connect" in details or "refused" in details):
                    state = DestState.REJECTED  # never reached P: nothing was accepted
                self._post(DestResult(room, state, error=f"{e.code().name}: {e.details()}"))
            except Exception as e:  # never lose the outcome
                self._post(DestResult(room, DestState.UNKNOWN, error=repr(e)))

        self._pool.submit(call)

    def abort(self, address: str, room: int, request_id: str, reason: str) -> None:
        def call():
            try:
                self._stub(address).Abort(common_pb2.AbortRequest(request_id=request_id, room=room,
                                                                  reason=reason),
                                          timeout=self.rpc_timeout_s)
            except grpc.RpcError as e:
                log.info("abort of room %d on %s failed: %s", room, address, e.code().name)

        self._pool.submit(call)

    def check_alive(self, peers: set[tuple[str, str]]) -> None:
        """For each (segment, incarnation): post ``PeerGone(segment, incarnation)`` when the
        registry no longer has that incarnation, or its same-host owner process exited."""
        if self.registry is None or self._checking:
            return
        self._checking = True

        def call():
            try:
                from transfer_svc.engine import host_id, pid_start_ticks

                me = host_id()
                for seg, inc in peers:
                    try:
                        desc = self.registry.get_segment(seg, refresh=True)
                    except KeyError:
                        self._post(PeerGone(seg, inc))
                        continue
                    except grpc.RpcError:
                        continue  # registry unreachable: decide nothing
                    gone = bool(inc) and desc.incarnation != inc
                    if not gone and desc.host_id == me and desc.pid > 0:
                        gone = pid_start_ticks(desc.pid) != desc.pid_start_ticks
                    if gone:
                        self._post(PeerGone(seg, inc))
            except Exception:
                log.exception("liveness check")
            finally:
                self._checking = False

        self._pool.submit(call)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for ch in self._channels.values():
                ch.close()
