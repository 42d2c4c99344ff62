"""The decode scheduler in one process: a tiny random-weight model, a stub KV receiver the test feeds
P's notices into, and a stub network that records SetDestination / Abort / liveness calls.

There is no prefill worker: the test plays P by computing the delta's K/V itself, with a forward on
D's own runner over ``row[pre_len:prompt_len]`` (the slots D sent), and then sending the notice with
the co-located engine's first token. D's streamed tokens must then equal the co-located engine's,
which they only do when D reads the delta at ``row[pre_len:]`` and the prefix from its radix cache.

Most tests drive the scheduler step by step (inbox drain + one iteration, as its thread does); one
runs the real thread. After each test the KV accounting is exact: free + evictable + locked + owned
== pool, no lock, no row, no room held.
"""

from __future__ import annotations

import time

import grpc
import torch

from decode_svc.jobs import DestState, JobState
from decode_svc.messages import DestResult, PeerGone
from decode_svc.quarantine import FencePolicy
from protos import prefill_pb2
from telemetry import metrics as M
from tests.unit.decode_harness import (  # noqa: F401
    P_ADDR, P_INC, P_SEG, PROMPT, PS, Decode, chunks, code, model, outcome, reference, released)


def test_commit_streams_the_colocated_tokens(model, reference):
    d = Decode(model, checksums=True)
    ref = reference(PROMPT, 6)
    job = d.submit(PROMPT, 6)
    d.tick()
    dest = d.net.dests[job.room]
    assert (dest.pre_len, dest.prompt_len, dest.decode_segment) == (0, 10, "decode-0")
    assert len(dest.dst_page_ids) == 3 and dest.want_checksums
    assert job.state is JobState.TRANSFER and job.dest_state is DestState.SENDING
    d.tick()  # SetDestination's answer
    assert job.dest_state is DestState.ACCEPTED and job.prefill_segment == P_SEG
    assert len(job.lease.own_pages) == 4  # 10 + min(reserve, 6 - 1) slots
    d.prefill(job, ref[0], checksums=True)
    d.run_until_done(job)
    toks, end = outcome(job)
    assert end is None and toks == ref and job.finish_reason == "length"
    d.assert_idle()


def test_prefix_hit_sends_only_the_delta(model, reference):
    """A prompt sharing 2 pages with a finished one: the row is [radix prefix | delta], only the
    delta's pages go to P, and the checksums D verifies are over row[pre_len:], not row[:n]."""
    d = Decode(model, checksums=True)
    d.serve(PROMPT, 3, reference, checksums=True)
    prompt = PROMPT[:8] + [3, 44, 51, 6, 29]  # 13 tokens, the first 8 cached
    ref = reference(prompt, 5)
    b = d.submit(prompt, 5)
    d.tick()
    dest, lease = d.net.dests[b.room], b.lease
    assert (lease.pre_len, dest.pre_len, dest.prompt_len) == (8, 8, 13)
    r2t = d.runner.req_to_token_pool.req_to_token
    prefix_slots, _ = d.sched.kv.cache.match_prefix(prompt)
    assert torch.equal(r2t[lease.row, :8], prefix_slots)
    delta = r2t[lease.row, 8:13]
    assert list(dest.dst_page_ids) == (delta[::PS] // PS).tolist() == b.dst_pages
    assert len(dest.dst_page_ids) == 2
    assert set(dest.dst_page_ids).isdisjoint((prefix_slots // PS).tolist())
    d.prefill(b, ref[0], checksums=True)
    d.run_until_done(b)
    got, end = chunks(b)
    assert end is None and [c.token_ids[0] for c in got] == ref
    first = got[0]
    assert (first.decode_prefix_tokens, first.kv_pages_transferred, first.prompt_tokens) == (8, 2, 13)
    d.assert_idle()


def test_full_hit_sends_no_page(model, reference):
    d = Decode(model)
    prompt = PROMPT[:8]
    d.serve(prompt, 2, reference)
    b = d.submit(prompt, 4)
    d.tick()
    dest = d.net.dests[b.room]
    assert (dest.pre_len, list(dest.dst_page_ids)) == (8, [])
    d.finish(b, reference(prompt, 4))
    d.assert_idle()


def test_short_pool_evicts_cached_pages(model, reference):
    d = Decode(model, num_pages=6)
    d.serve(PROMPT, 6, reference)  # 4 pages; 3 stay cached after it
    assert d.load().accounting.evictable_pages == 3
    before = M.DECODE_EVICTED_PAGES._value.get()
    other = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    b = d.submit(other, 5)  # 4 pages: the 3 free and 1 evicted
    d.tick()
    assert b.state is JobState.TRANSFER and M.DECODE_EVICTED_PAGES._value.get() - before == 1
    d.finish(b, reference(other, 5))
    d.assert_idle()


def test_without_radix_cache(model, reference):
    d = Decode(model, disable_radix_cache=True)
    ref = reference(PROMPT, 4)
    for _ in range(2):
        job = d.submit(PROMPT, 4)
        d.tick()
        assert d.net.dests[job.room].pre_len == 0
        d.finish(job, ref)
    d.assert_idle()
    assert d.load().accounting.free_pages == d.load().accounting.total_pages


def test_bad_notices_fail_without_quarantine(model):
    d = Decode(model, checksums=True)
    failed = d.submit(PROMPT)
    short = d.submit(PROMPT)
    corrupt = d.submit(PROMPT)
    d.tick()
    d.recv.send(prefill_pb2.KVNotice(room=failed.room, ok=False, error="boom"))
    d.recv.send(prefill_pb2.KVNotice(room=short.room, ok=True, pages_sent=2))
    d.recv.send(prefill_pb2.KVNotice(room=corrupt.room, ok=True, pages_sent=3, head_checksums=[1, 2, 3] * 3))
    d.tick()
    assert code(outcome(failed)[1]) is grpc.StatusCode.UNAVAILABLE
    assert code(outcome(short)[1]) is grpc.StatusCode.DATA_LOSS
    assert code(outcome(corrupt)[1]) is grpc.StatusCode.DATA_LOSS
    assert d.net.aborts == []  # P answered: nothing to abort, nothing quarantined
    d.assert_idle()


def test_max_tokens_one_ends_on_the_first_token(model):
    d = Decode(model)
    job = d.submit(PROMPT, 1)
    d.tick()
    d.prefill(job, 7)
    d.tick()
    assert outcome(job) == ([7], None) and job.finish_reason == "length"
    d.assert_idle()


def test_abort_in_prealloc(model):
    d = Decode(model, num_pages=6)
    head = d.submit(PROMPT, 8)          # 5 of the 6 pages
    queued = d.submit(PROMPT, 8)        # must wait for pages
    d.tick(2)
    assert queued.state is JobState.PREALLOC and queued.room not in d.net.dests
    assert d.load().waiting_requests == 1
    assert d.sched.abort(queued.room, queued.request_id, "client gone")
    d.tick()
    assert code(outcome(queued)[1]) is grpc.StatusCode.CANCELLED
    assert d.sched.abort(head.room, head.request_id, "client gone")
    d.tick()
    assert code(outcome(head)[1]) is grpc.StatusCode.CANCELLED
    assert d.net.aborts[0][1] == head.room  # head's destination was accepted: P is told
    d.recv.send(prefill_pb2.KVNotice(room=head.room, ok=False, error="aborted"))
    d.tick()
    d.assert_idle()
    assert not d.sched.abort(queued.room, queued.request_id, "again")


def test_abort_in_transfer_quarantines_until_the_late_notice(model):
    d = Decode(model)
    job = d.submit(PROMPT)
    d.tick()
    dst = list(d.net.dests[job.room].dst_page_ids)
    d.sched.abort(0, job.request_id, "client gone")  # by request id
    d.tick()
    assert code(outcome(job)[1]) is grpc.StatusCode.CANCELLED
    assert d.net.aborts == [(P_ADDR, job.room, job.request_id, "aborted: client gone")]
    a = d.load().accounting
    assert (a.owned_pages, a.held_rooms, a.held_req_slots) == (len(dst), 1, 0)
    dup = d.submit(PROMPT, room=job.room)  # the room is taken while P may write its pages
    d.tick()
    assert code(outcome(dup)[1]) is grpc.StatusCode.ALREADY_EXISTS
    d.recv.send(prefill_pb2.KVNotice(room=job.room, ok=True, pages_sent=len(dst), first_token_id=3))
    d.tick()
    d.assert_idle()


def test_abort_while_sending_then_destination_results(model):
    """Quarantined before SetDestination answered: ACCEPTED -> P is asked to drop it (its notice
    releases the pages); REJECTED -> released at once."""
    d = Decode(model)
    d.net.reply = None
    acc, rej = d.submit(PROMPT), d.submit(PROMPT)
    d.tick()
    for j in (acc, rej):
        d.sched.abort(j.room, j.request_id, "gone")
    d.tick()
    assert d.net.aborts == [] and d.load().accounting.held_rooms == 2
    d.sched.post(DestResult(acc.room, DestState.ACCEPTED, P_SEG, P_INC))
    d.sched.post(DestResult(rej.room, DestState.REJECTED, error="NOT_FOUND: no"))
    d.tick()
    assert d.net.aborts == [(P_ADDR, acc.room, "", "decode request ended")]
    assert d.load().accounting.held_rooms == 1
    d.recv.send(prefill_pb2.KVNotice(room=acc.room, ok=False, error="aborted"))
    d.tick()
    d.assert_idle()


def test_destination_outcomes_fail_the_request(model):
    d = Decode(model)
    d.net.reply = None
    rej, unk = d.submit(PROMPT), d.submit(PROMPT)
    d.tick()
    d.sched.post(DestResult(rej.room, DestState.REJECTED, error="FAILED_PRECONDITION: x"))
    d.sched.post(DestResult(unk.room, DestState.UNKNOWN, error="DEADLINE_EXCEEDED: y"))
    d.tick()
    assert code(outcome(rej)[1]) is grpc.StatusCode.ABORTED
    assert code(outcome(unk)[1]) is grpc.StatusCode.UNAVAILABLE
    assert d.load().accounting.held_rooms == 1  # P may hold the unknown one: its pages wait
    d.recv.send(prefill_pb2.KVNotice(room=unk.room, ok=False))
    d.tick()
    d.assert_idle()


def test_abort_while_waiting_and_running(model, reference):
    d = Decode(model, max_running=1)
    ref = reference(PROMPT, 12)
    run, wait = d.submit(PROMPT, 12), d.submit(PROMPT, 12)
    d.tick()
    d.prefill(run, ref[0])
    d.prefill(wait, ref[0])
    d.tick(3)
    assert (run.state, wait.state) == (JobState.RUNNING, JobState.WAITING)
    assert d.load().running_requests == 2
    d.sched.abort(wait.room, wait.request_id, "x")
    d.tick()
    toks, end = outcome(wait)
    assert toks == [ref[0]] and code(end) is grpc.StatusCode.CANCELLED
    d.sched.abort(run.room, run.request_id, "x")
    d.tick()
    toks, end = outcome(run)
    assert code(end) is grpc.StatusCode.CANCELLED and toks == ref[:len(toks)] and len(toks) >= 3
    assert d.net.aborts == []
    d.assert_idle()
    assert d.load().accounting.evictable_pages >= 2  # the committed prompt pages stay cached


def test_kv_wait_timeout_then_fence_deadline(model):
    fence = FencePolicy(rpc_timeout_s=0.2, write_window_s=0.3, margin_s=0.3)
    d = Decode(model, kv_wait_timeout_s=0.05, fence=fence)
    before = released("fence_deadline")
    t0 = time.monotonic()
    job = d.submit(PROMPT)
    d.tick()
    dest = d.net.dests[job.room]
    assert dest.write_deadline_ms == 300  # the window P applies
    assert t0 + 0.8 <= job.fence_at <= time.monotonic() + 0.8  # RPC deadline + window + margin
    time.sleep(0.08)
    d.tick()
    assert code(outcome(job)[1]) is grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(d.net.aborts) == 1 and d.load().accounting.held_rooms == 1
    d.sched.post(PeerGone(P_SEG, P_INC, "absent"))  # an expired lease proves nothing
    d.tick()
    assert d.load().accounting.owned_pages == 3  # still fenced: P may be writing
    time.sleep(max(0.0, job.fence_at - time.monotonic()) + 0.05)
    d.tick()
    d.assert_idle()
    assert released("fence_deadline") == before + 1


def test_peer_gone_fails_transfers_and_releases_quarantine(model):
    d = Decode(model, liveness_interval_s=0.0)
    waiting, aborted = d.submit(PROMPT), d.submit(PROMPT)
    d.tick(2)  # pre-allocated, then SetDestination's answer names P's segment
    assert d.net.alive_checks[-1] == {(P_SEG, P_INC, None)}
    d.sched.abort(aborted.room, aborted.request_id, "x")
    d.tick()
    d.sched.post(PeerGone(P_SEG, "other-incarnation"))
    d.tick()
    assert waiting.state is JobState.TRANSFER and d.load().accounting.held_rooms == 2
    d.sched.post(PeerGone(P_SEG, P_INC))
    d.tick()
    assert code(outcome(waiting)[1]) is grpc.StatusCode.UNAVAILABLE
    d.assert_idle()


def test_duplicate_live_room_is_already_exists(model, reference):
    d = Decode(model)
    ref = reference(PROMPT, 3)
    job = d.submit(PROMPT, 3, room=42)
    dup = d.submit(PROMPT, 3, room=42)
    d.tick()
    assert code(outcome(dup)[1]) is grpc.StatusCode.ALREADY_EXISTS
    d.finish(job, ref)
    d.assert_idle()


def test_overlap_schedule_matches_and_frees_after_the_step(model, reference):
    d = Decode(model, overlap_schedule=True)
    ref_a, ref_b = reference(PROMPT, 8), reference(PROMPT[:6], 20)
    a, b = d.submit(PROMPT, 8), d.submit(PROMPT[:6], 20)
    d.tick()
    d.prefill(a, ref_a[0])
    d.prefill(b, ref_b[0])
    d.run_until_done(a)
    assert outcome(a) == (ref_a, None)
    assert d.sched.running.overlap.busy  # b's next step is in flight
    d.sched.abort(b.room, b.request_id, "x")
    d.sched.inbox.drain(0, d.sched.handle)
    assert d.sched.running.overlap.deferred_pages > 0  # b's pages wait for the step writing them
    d.tick()
    toks, end = outcome(b)
    assert code(end) is grpc.StatusCode.CANCELLED and toks == ref_b[:len(toks)]
    d.assert_idle()


def test_thread_streams_answers_load_and_shutdown(model):
    d = Decode(model)
    d.sched.start()
    try:
        job = d.submit(PROMPT, 2)
        deadline = time.monotonic() + 10
        while job.room not in d.net.dests:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        d.recv.send(prefill_pb2.KVNotice(room=job.room, ok=True, pages_sent=3, first_token_id=11))
        first = job.out.get(timeout=10)
        assert list(first.token_ids) == [11]
        assert len(job.out.get(timeout=10).token_ids) == 1 and job.out.get(timeout=10) is None
        pending = d.submit(PROMPT, 2)
        while d.sched.load().transferring_requests != 1:
            time.sleep(0.01)
    finally:
        d.sched.stop()
    assert code(pending.out.get(timeout=1)) is grpc.StatusCode.UNAVAILABLE
