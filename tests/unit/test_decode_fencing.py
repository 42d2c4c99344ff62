"""D's release rules for quarantined destination pages (docs/architecture.md, Fencing one-sided
writes): only P's answer, a rejection proving P holds nothing, proof that P is gone or the fence
deadline free them; a registry record that is merely absent decides nothing."""

from __future__ import annotations

import grpc
import pytest

from decode_svc.jobs import DestState, JobState
from decode_svc.messages import DestResult, PeerGone, ProcessId
from decode_svc.peers import PrefillPeers, destination_state
from protos import prefill_pb2
from tests.unit.decode_harness import P_INC, P_SEG, PROMPT, Decode, code, model, outcome, released  # noqa: F401
from transfer_svc.engine import host_id, pid_start_ticks


def _pages(d) -> int:
    return d.load().accounting.owned_pages


def test_absent_record_fails_fast_but_keeps_pages_until_the_notice(model):
    d = Decode(model)
    waiting, aborted = d.submit(PROMPT), d.submit(PROMPT)
    d.tick(2)
    d.sched.abort(aborted.room, aborted.request_id, "x")
    d.tick()
    before = released("notice")
    d.sched.post(PeerGone(P_SEG, P_INC, "absent"))
    d.tick()
    assert code(outcome(waiting)[1]) is grpc.StatusCode.UNAVAILABLE  # the router may retry now
    a = d.load().accounting
    assert a.held_rooms == 2 and a.owned_pages == 6  # both rooms' pages stay quarantined
    for job in (waiting, aborted):
        d.recv.send(prefill_pb2.KVNotice(room=job.room, ok=False, error="aborted"))
    d.tick()
    d.assert_idle()
    assert released("notice") == before + 2


@pytest.mark.parametrize("cause", ["process_gone", "new_incarnation"])
def test_proof_of_death_releases(model, cause):
    d = Decode(model, liveness_interval_s=0.0)
    d.net.reply = None
    job = d.submit(PROMPT)
    d.tick()
    proc = ProcessId("host-a", 4242, 99)
    d.sched.post(DestResult(job.room, DestState.ACCEPTED, P_SEG, P_INC, process=proc))
    d.tick()
    assert (P_SEG, P_INC, proc) in d.net.alive_checks[-1]  # the process travels with the pages
    d.sched.abort(job.room, job.request_id, "x")
    d.tick(2)
    assert (P_SEG, P_INC, proc) in d.net.alive_checks[-1]
    before = released(cause)
    d.sched.post(PeerGone(P_SEG, "another-inc", cause))
    d.tick()
    assert _pages(d) == 3  # another incarnation's death says nothing about this one
    d.sched.post(PeerGone(P_SEG, P_INC, cause))
    d.tick()
    d.assert_idle()
    assert released(cause) == before + 1


def test_rejected_destination_releases_at_once(model):
    d = Decode(model)
    d.net.reply = None
    job = d.submit(PROMPT)
    d.tick()
    d.sched.abort(job.room, job.request_id, "x")
    d.tick()
    before = released("rejected")
    d.sched.post(DestResult(job.room, DestState.REJECTED, error="ABORTED: room was aborted"))
    d.tick()
    d.assert_idle()
    assert released("rejected") == before + 1


class _Err(grpc.RpcError):
    def __init__(self, code, details):
        self._c, self._d = code, details

    def code(self):
        return self._c

    def details(self):
        return self._d


@pytest.mark.parametrize("code_, details, state", [
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: "
     "ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused", DestState.REJECTED),
    (grpc.StatusCode.UNAVAILABLE, "Connection reset by peer", DestState.UNKNOWN),
    (grpc.StatusCode.UNAVAILABLE, "Socket closed", DestState.UNKNOWN),
    (grpc.StatusCode.UNAVAILABLE, "recvmsg:Connection reset by peer (failed to connect?)", DestState.UNKNOWN),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", DestState.UNKNOWN),
    (grpc.StatusCode.FAILED_PRECONDITION, "page size", DestState.REJECTED),
])
def test_destination_errors_are_unknown_unless_nothing_was_sent(code_, details, state):
    assert destination_state(_Err(code_, details)) is state


class _Registry:
    def __init__(self, desc=None):
        self.desc = desc

    def get_segment(self, name, refresh=False):
        if self.desc is None:
            raise KeyError(name)
        return self.desc


def test_liveness_proves_death_only_from_the_process_or_a_new_incarnation():
    import os

    from protos import registry_pb2

    peers = PrefillPeers(lambda m: None, registry=_Registry())
    try:
        me = host_id()
        alive = ProcessId(me, os.getpid(), pid_start_ticks(os.getpid()))
        dead = ProcessId(me, os.getpid(), pid_start_ticks(os.getpid()) + 1)  # pid reused by another start
        # no registry record at all: the recorded process still decides
        assert peers._gone(P_SEG, P_INC, alive) == ""
        assert peers._gone(P_SEG, P_INC, dead) == "process_gone"
        assert peers._gone(P_SEG, P_INC, None) == "absent"
        assert peers._gone(P_SEG, P_INC, ProcessId("other-host", 1, 1)) == "absent"
        peers.registry.desc = registry_pb2.SegmentDescriptor(name=P_SEG, incarnation="inc-2")
        assert peers._gone(P_SEG, P_INC, None) == "new_incarnation"
        peers.registry.desc = registry_pb2.SegmentDescriptor(name=P_SEG, incarnation=P_INC)
        assert peers._gone(P_SEG, P_INC, None) == ""
    finally:
        peers.close()


def test_a_tensor_parallel_p_is_gone_only_once_every_rank_is():
    """Each follower rank posts its own puts: rank 0's exit proves nothing while one of them runs,
    nor while a follower's process is not named (a descriptor from an older P)."""
    import os

    from protos import registry_pb2

    peers = PrefillPeers(lambda m: None, registry=_Registry())
    try:
        me, pid = host_id(), os.getpid()
        live, dead = (pid, pid_start_ticks(pid)), (pid, pid_start_ticks(pid) + 1)
        assert peers._gone(P_SEG, P_INC, ProcessId(me, *dead, (live,))) == ""
        assert peers._gone(P_SEG, P_INC, ProcessId(me, *dead, (dead, dead))) == "process_gone"
        assert peers._gone(P_SEG, P_INC, ProcessId(me, *dead, None)) == "absent"  # the registry decides
        desc = registry_pb2.SegmentDescriptor(name=P_SEG, incarnation=P_INC, host_id=me, pid=dead[0],
                                              pid_start_ticks=dead[1])
        desc.regions.add(rank=0)
        follower = desc.regions.add(rank=1, pid=live[0], pid_start_ticks=live[1])
        peers.registry.desc = desc
        assert peers._gone(P_SEG, P_INC, None) == ""
        follower.pid_start_ticks = dead[1]
        assert peers._gone(P_SEG, P_INC, None) == "process_gone"
        follower.pid = 0  # not named
        assert ProcessId.of(desc).ranks is None and peers._gone(P_SEG, P_INC, None) == ""
    finally:
        peers.close()


def test_a_job_whose_p_is_proven_gone_frees_its_pages_without_quarantine(model):
    d = Decode(model)
    job = d.submit(PROMPT)
    d.tick(2)
    d.sched.post(PeerGone(P_SEG, P_INC, "process_gone"))
    d.tick()
    assert code(outcome(job)[1]) is grpc.StatusCode.UNAVAILABLE and job.state is JobState.DONE
    d.assert_idle()


class _Stub:
    """SetDestination answering from ``outcomes`` in turn (an exception is raised)."""

    def __init__(self, *outcomes):
        self.outcomes, self.sent = list(outcomes), []

    def SetDestination(self, dest, timeout):
        self.sent.append(prefill_pb2.KVDestination.FromString(dest.SerializeToString()))
        out = self.outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out


class _Starts(_Registry):
    """A registry whose cached descriptor may be older than the refreshed one."""

    def __init__(self, cached, fresh):
        super().__init__(cached)
        self.fresh = fresh

    def get_segment(self, name, refresh=False):
        assert name == P_SEG
        return self.fresh if refresh else self.desc


def _send(peers, stub, worker_id=P_SEG):
    import queue

    posted = queue.SimpleQueue()
    peers._post = posted.put
    peers._stub = lambda address: stub
    peers.set_destination("127.0.0.1:1", prefill_pb2.KVDestination(room=7, decode_segment="decode-0"),
                          "r", prefill_worker_id=worker_id)
    return posted.get(timeout=10)


def _desc(inc, pid=4242, ticks=99):
    from protos import registry_pb2

    return registry_pb2.SegmentDescriptor(name=P_SEG, incarnation=inc, host_id="host-a", pid=pid,
                                          pid_start_ticks=ticks)


def test_a_lost_destination_outcome_names_the_start_it_was_pinned_to():
    """P died with SetDestination in flight (UNKNOWN): the destination was pinned to the worker's
    registered start, so the result carries that start and its process, whose death alone then
    proves nobody writes the pages. Without a worker id nothing is pinned or named."""
    peers = PrefillPeers(lambda m: None, registry=_Registry(_desc(P_INC)))
    try:
        stub = _Stub(_Err(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
        r = _send(peers, stub)
        assert stub.sent[0].prefill_incarnation == P_INC
        assert (r.state, r.segment, r.incarnation, r.process) == (
            DestState.UNKNOWN, P_SEG, P_INC, ProcessId("host-a", 4242, 99))
        stub = _Stub(_Err(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
        r = _send(peers, stub, worker_id="")
        assert stub.sent[0].prefill_incarnation == ""
        assert (r.state, r.segment, r.incarnation, r.process) == (DestState.UNKNOWN, "", "", None)
    finally:
        peers.close()


def test_a_destination_pinned_to_a_stale_start_is_sent_again_to_the_current_one():
    peers = PrefillPeers(lambda m: None, registry=_Starts(_desc("inc-old", pid=1), _desc(P_INC)))
    try:
        refused = _Err(grpc.StatusCode.FAILED_PRECONDITION, "prefill_incarnation: 'inc-old' is not this start")
        stub = _Stub(refused, prefill_pb2.SetDestinationResponse(prefill_segment=P_SEG, incarnation=P_INC))
        r = _send(peers, stub)
        assert [d.prefill_incarnation for d in stub.sent] == ["inc-old", P_INC]
        assert (r.state, r.segment, r.incarnation, r.process) == (
            DestState.ACCEPTED, P_SEG, P_INC, ProcessId("host-a", 4242, 99))
        # refused by the current start too (a wrong worker id): a definite answer, P holds nothing
        stub = _Stub(refused, refused)
        assert _send(peers, stub).state is DestState.REJECTED and len(stub.sent) == 2
    finally:
        peers.close()


def test_an_ambiguous_failure_is_never_sent_again():
    """Only P's definite refusal of another start is resent: after a lost outcome P may hold the
    destination, and a second one for the room must not exist."""
    peers = PrefillPeers(lambda m: None, registry=_Registry(_desc(P_INC)))
    try:
        stub = _Stub(_Err(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
                     prefill_pb2.SetDestinationResponse(prefill_segment=P_SEG, incarnation=P_INC))
        r = _send(peers, stub)
        assert len(stub.sent) == 1 and (r.state, r.incarnation) == (DestState.UNKNOWN, P_INC)
    finally:
        peers.close()


@pytest.mark.parametrize("abort_first", [False, True])
def test_a_lost_outcome_pinned_to_a_start_is_released_by_that_start_dying(model, abort_first):
    """D's side of the pinned lost outcome (the DestResult PrefillPeers posts, tested above): the
    request fails or was already aborted while its SetDestination was in flight; either way the
    quarantined room follows the pinned start, and only that start's death releases it."""
    d = Decode(model, liveness_interval_s=0.0)
    d.net.reply = None
    job = d.submit(PROMPT)
    d.tick()
    if abort_first:  # quarantined while sending: no segment known yet
        d.sched.abort(job.room, job.request_id, "client gone")
        d.tick()
        assert code(outcome(job)[1]) is grpc.StatusCode.CANCELLED
    proc = ProcessId("host-a", 4242, 99)
    d.sched.post(DestResult(job.room, DestState.UNKNOWN, P_SEG, P_INC, error="UNAVAILABLE: Socket closed",
                            process=proc))
    d.tick()
    if not abort_first:
        assert code(outcome(job)[1]) is grpc.StatusCode.UNAVAILABLE
    assert _pages(d) == 3 and (P_SEG, P_INC, proc) in d.net.alive_checks[-1]
    d.sched.post(PeerGone(P_SEG, "another-inc", "process_gone"))
    d.tick()
    assert _pages(d) == 3
    before = released("process_gone")
    d.sched.post(PeerGone(P_SEG, P_INC, "process_gone"))
    d.tick()
    d.assert_idle()
    assert released("process_gone") == before + 1
