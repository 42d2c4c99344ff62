"""PrefillScheduler in one process: a real (tiny, random-weight) ModelRunner on P, a second KV pool
standing in for D's, and the in-process fake transport between them (``tests/fakes/transfer.py``).

Covers the delta contract (logical pages ``[pre_len/ps, ceil(len/ps))`` of D's ``pre_len`` go to
D's pages; the bytes land), P's prefix hit, chunked sends of whole pages, the ok notice, destination
mismatches, aborts, failed batches, timeouts and admission, with the KV accounting exact after each.
"""

from __future__ import annotations

import time

import grpc
import pytest

from engine.sampling_params import SamplingParams
from pd_common.head_checksums import head_checksums
from prefill_svc.jobs import JobState, PrefillJob
from protos import prefill_pb2
from tests.unit.prefill_harness import PS, error_of, model, pair, prompt, wait_until  # noqa: F401


# ---------------------------------------------------------------------- the delta
@pytest.mark.parametrize("dest_first", [True, False], ids=["destination-first", "prefill-first"])
def test_delta_pages_land_and_the_ok_notice_follows(pair, dest_first):
    pd = pair(checksums=True)
    ids, room = prompt(1, 22), 11
    dest = pd.destination(room, len(ids), pre_len=8)
    if dest_first:
        pd.offer(dest)
        job = pd.submit(ids, room)
    else:
        job = pd.submit(ids, room)
        pd.wait_state(room, JobState.WAIT_DEST)
        pd.offer(dest)
    res = job.reply.result(10)
    assert pd.assert_pages_landed(room, dest) == [2, 3, 4, 5]  # [8/4, ceil(22/4))
    first = pd.assert_kv_is(dest, ids)
    (notice,) = pd.notices()
    assert notice.ok and notice.room == room and notice.error == ""
    assert notice.first_token_id == res.first_token_id == first
    assert notice.first_logprob == res.first_logprob
    assert notice.pages_sent == res.pages_sent == 4 and notice.cached_tokens == res.cached_tokens == 0
    assert list(notice.head_checksums) == [c for row in head_checksums(pd.d_pool, list(dest.msg.dst_page_ids))
                                           for c in row]
    assert res.bytes_sent == 4 * pd.runner.kv_pool.page_stride_bytes
    pd.no_more_notices()
    pd.assert_idle_accounting()


@pytest.mark.parametrize("d_pre", [0, 8, 16])
def test_p_prefix_hit_still_sends_the_delta_of_ds_pre_len(pair, d_pre):
    """P caches the first prompt's pages; the second shares 16 tokens with it, so P computes only
    its tail. What D gets depends on D's pre_len alone, prefix pages from P's cache included."""
    pd = pair()
    a = prompt(2, 22)
    b = a[:16] + prompt(3, 6)
    pd.offer(pd.destination(1, len(a)))
    assert pd.submit(a, 1).reply.result(10).cached_tokens == 0
    dest = pd.destination(2, len(b), pre_len=d_pre)
    pd.offer(dest)
    res = pd.submit(b, 2).reply.result(10)
    assert res.cached_tokens == 16                          # P's hit: 4 full pages
    assert pd.assert_pages_landed(2, dest) == list(range(d_pre // PS, 6))
    assert pd.assert_kv_is(dest, b) == res.first_token_id
    notices = pd.notices(2)
    assert [n.ok for n in notices] == [True, True] and notices[1].cached_tokens == 16
    assert notices[1].pages_sent == res.pages_sent == 6 - d_pre // PS
    acc = pd.assert_idle_accounting()
    assert acc.evictable_pages == 5 + 5 - 4                  # both prompts' full pages, prefix once


def test_chunked_prompt_sends_whole_computed_pages_per_chunk(pair):
    pd = pair(chunked_prefill_size=6)
    ids, room = prompt(4, 22), 7
    dest = pd.destination(room, len(ids))
    pd.offer(dest)
    res = pd.submit(ids, room).reply.result(10)
    # computed 6, 12, 18, 22 tokens: whole pages [0,1), [1,3), [3,4), then the rest with the tail
    assert [b["logical_pages"] for b in pd.batches(room)] == [[0], [1, 2], [3], [4, 5]]
    assert pd.assert_pages_landed(room, dest) == list(range(6))
    assert pd.assert_kv_is(dest, ids) == res.first_token_id
    assert pd.notices()[0].ok
    pd.assert_idle_accounting()


# ---------------------------------------------------------------------- destination mismatches
MISMATCHES = {
    "pre_len": (dict(pre_len=5, pages=[1, 2, 3, 4, 5]), "pre_len 5"),
    "page count": (dict(pages=[1, 2, 3]), "destination has 3 pages; the delta needs 4"),
    "prompt_len": (dict(prompt_len=15), "prompt_len 15"),
    "page id": (dict(pages=[1, 2, 3, 99]), "outside the decode pool"),
    "page size": (dict(segment="decode-ps8"), "--page-size"),
    "layout": (dict(segment="decode-lm"), "--kv-layout"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_destination_mismatch_is_failed_precondition_with_an_ok_false_notice(pair, case):
    pd = pair()
    pd.add_decode("decode-ps8", page_size=8)
    pd.add_decode("decode-lm", layout="layer_major")
    kw, why = MISMATCHES[case]
    segment = kw.pop("segment", "decode-0")
    ids, room = prompt(5, 14), 21
    dest = pd.destination(room, len(ids), segment=segment, pages=kw.pop("pages", [1, 2, 3, 4]), **kw)
    pd.offer(dest)
    err = error_of(pd.submit(ids, room))
    assert err.code is grpc.StatusCode.FAILED_PRECONDITION and why in str(err), err
    d = pd.fabric.published[segment]
    (notice,) = [prefill_pb2.KVNotice.FromString(n.payload) for n in d.wait_notify(10)]
    assert not notice.ok and notice.room == room and why in notice.error
    assert pd.batches(room) == []
    pd.assert_idle_accounting()


# ---------------------------------------------------------------------- aborts and failures
def test_abort_before_prefill_answers_the_buffered_destination(pair):
    pd = pair()
    ids, room = prompt(6, 10), 31
    pd.offer(pd.destination(room, len(ids)))
    assert pd.sched.abort(room, "", "router gave up")        # known: its destination is buffered
    (notice,) = pd.notices()
    assert not notice.ok and notice.room == room and "router gave up" in notice.error
    assert error_of(pd.submit(ids, room)).code is grpc.StatusCode.ABORTED   # tombstoned
    pd.assert_idle_accounting()


def test_abort_while_waiting_for_the_destination(pair):
    pd = pair()
    ids, room = prompt(7, 10), 32
    job = pd.submit(ids, room)
    pd.wait_state(room, JobState.WAIT_DEST)
    assert pd.sched.abort(0, job.request_id, "client left")  # by request id
    err = error_of(job)
    assert err.code is grpc.StatusCode.CANCELLED and "client left" in str(err)
    assert pd.sched.offer_destination(pd.destination(room, len(ids))) == "aborted"
    pd.no_more_notices()                                      # no destination was accepted
    pd.assert_idle_accounting()


def test_abort_while_transferring_keeps_the_source_pages_until_the_batch_ends(pair):
    pd = pair()
    ids, room = prompt(8, 22), 33
    pd.fabric.hold("decode-0")
    dest = pd.destination(room, len(ids))
    pd.offer(dest)
    job = pd.submit(ids, room)
    assert wait_until(lambda: pd.fabric.held("decode-0") == 1)
    assert pd.sched.abort(room, "", "cancelled")
    time.sleep(0.1)
    assert not job.reply.done()                               # the batch may still read P's pages
    rep = pd.sched.load()
    assert rep.transferring_requests == 1 and rep.accounting.held_req_slots == 1
    assert rep.accounting.owned_pages == 6, rep.accounting      # all 6 pages still allocated
    pd.fabric.release_held()
    assert error_of(job).code is grpc.StatusCode.CANCELLED
    pd.assert_pages_landed(room, dest)
    # the ok notice was queued behind the data before the abort: D gets it, and nothing else
    (notice,) = pd.notices()
    assert notice.ok and notice.room == room
    pd.no_more_notices()
    pd.assert_idle_accounting()


def test_failed_batch_is_unavailable_with_an_ok_false_notice(pair):
    pd = pair()
    ids, room = prompt(9, 22), 34
    pd.fabric.hold("decode-0")
    pd.offer(pd.destination(room, len(ids)))
    job = pd.submit(ids, room)
    assert wait_until(lambda: pd.fabric.held("decode-0") == 1)
    pd.fabric.fail_held("peer reset")
    err = error_of(job)
    # the failure reaches the job either through the failed batch's status ("KV transfer failed")
    # or, when P submits its next batch first, through the dropped segment ("KV transfer to decode
    # failed: ... dropped (peer reset)"); which one wins is thread timing, the outcome is the same
    assert err.code is grpc.StatusCode.UNAVAILABLE and "peer reset" in str(err), err
    assert "KV transfer" in str(err) and "failed" in str(err), err
    # the handle was dropped with the batch; P reopens the segment for the ok=false notice
    (notice,) = pd.notices()
    assert not notice.ok and notice.room == room and "peer reset" in notice.error
    pd.no_more_notices()
    pd.assert_idle_accounting()


def test_dropped_segment_at_submit_is_unavailable(pair):
    pd = pair()
    ids, room = prompt(10, 10), 35
    dest = pd.destination(room, len(ids))
    pd.fabric.drop(dest.segment, "peer exited")
    pd.offer(dest)
    err = error_of(pd.submit(ids, room))
    assert err.code is grpc.StatusCode.UNAVAILABLE and "KV transfer to decode failed" in str(err)
    assert not pd.notices()[0].ok
    pd.assert_idle_accounting()


def test_destination_timeouts_both_ways(pair):
    pd = pair(dest_timeout_s=0.3)
    ids = prompt(11, 10)
    job = pd.submit(ids, 41)                                  # no destination ever
    pd.offer(pd.destination(42, len(ids)))                    # no request ever
    err = error_of(job)
    assert err.code is grpc.StatusCode.DEADLINE_EXCEEDED and "destination" in str(err)
    (notice,) = pd.notices()
    assert notice.room == 42 and not notice.ok and "expired" in notice.error
    pd.assert_idle_accounting()


# ---------------------------------------------------------------------- admission
def test_admission_is_fifo_and_refuses_only_what_can_never_be_freed(pair):
    pd = pair(num_pages=12)
    big = prompt(12, 40)                                       # 10 of the 12 pages
    a = pd.submit(big, 51)                                     # holds its pages: no destination yet
    pd.wait_state(51, JobState.WAIT_DEST)
    b = pd.submit(prompt(13, 40), 52)                          # must wait for A's pages
    c = pd.submit(prompt(14, 4), 53)                           # fits, but FIFO keeps it behind B
    assert wait_until(lambda: pd.sched.load().waiting_requests == 2)
    time.sleep(0.1)
    assert pd.sched.load().waiting_requests == 2
    for room, ids in ((51, big), (52, prompt(13, 40)), (53, prompt(14, 4))):
        pd.offer(pd.destination(room, len(ids)))
    assert [j.reply.result(10).room for j in (a, b, c)] == [51, 52, 53]
    pd.notices(3)
    err = error_of(pd.submit(prompt(15, 52), 54))             # 13 pages > 12, nothing to wait for
    assert err.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    pd.assert_idle_accounting()


def test_a_burst_sharing_a_prompt_computes_it_once(pair):
    """A job whose prompt is mostly pages another admitted job is computing waits for that job's
    release and takes them from the cache (a burst with one system prompt computed it once per
    request); jobs sharing nothing, or too little to be worth a wait, are admitted past it."""
    pd = pair()
    system = prompt(20, 32)                                   # 8 pages
    a_ids, b_ids = system + prompt(21, 3), system + prompt(22, 3)
    other = prompt(23, 10)                                    # shares nothing
    short_share = system[:8] + prompt(24, 30)                 # 2 shared pages of 38 tokens: no wait
    a = pd.submit(a_ids, 71)
    pd.wait_state(71, JobState.WAIT_DEST)                     # leased: its pages are not cached yet
    b = pd.submit(b_ids, 72)
    c = pd.submit(other, 73)
    d = pd.submit(short_share, 74)
    pd.wait_state(73, JobState.WAIT_DEST)
    pd.wait_state(74, JobState.WAIT_DEST)
    time.sleep(0.1)
    assert pd.sched.load().waiting_requests == 1 and pd.sched.jobs[72].state is JobState.QUEUED
    for room, ids in ((71, a_ids), (73, other), (74, short_share)):
        pd.offer(pd.destination(room, len(ids)))
    assert [j.reply.result(10).cached_tokens for j in (a, c, d)] == [0, 0, 0]
    dest = pd.destination(72, len(b_ids))
    pd.offer(dest)
    res = b.reply.result(10)
    assert res.cached_tokens == 32                            # a's 8 pages, from the cache
    assert pd.assert_kv_is(dest, b_ids) == res.first_token_id
    pd.notices(4)
    pd.assert_idle_accounting()


def test_duplicate_room_and_load_report(pair):
    pd = pair()
    ids = prompt(16, 10)
    a = pd.submit(ids, 61)
    pd.wait_state(61, JobState.WAIT_DEST)
    assert error_of(pd.submit(ids, 61)).code is grpc.StatusCode.ALREADY_EXISTS
    rep = pd.sched.load()
    assert (rep.waiting_requests, rep.running_requests, rep.transferring_requests) == (0, 1, 0)
    assert rep.accounting.held_rooms == 1 and rep.accounting.owned_pages == 3
    pd.offer(pd.destination(61, len(ids)))
    assert a.reply.result(10).pages_sent == 3
    pd.assert_idle_accounting()


def test_a_call_deadline_bounds_the_wait_for_a_destination(pair):
    """D may queue a request under memory pressure for longer than --destination-timeout: a Prefill
    call with a deadline waits until that deadline, not the fixed timeout (which failed such requests)."""
    pd = pair(dest_timeout_s=0.3)
    ids = prompt(17, 10)
    job = PrefillJob(request_id="r71", room=71, prompt_ids=list(ids),
                     params=SamplingParams(max_tokens=4, temperature=0.0))
    job.destination_deadline = job.arrived + 30.0
    pd.sched.submit(job)
    time.sleep(1.0)                                            # past the 0.3 s fixed timeout
    assert not job.reply.done()
    pd.offer(pd.destination(71, len(ids)))
    assert job.reply.result(10).room == 71
    pd.notices()
    late = PrefillJob(request_id="r72", room=72, prompt_ids=list(prompt(18, 10)),
                      params=SamplingParams(max_tokens=4, temperature=0.0))
    late.destination_deadline = late.arrived + 0.5
    pd.sched.submit(late)
    err = error_of(late)
    assert err.code is grpc.StatusCode.DEADLINE_EXCEEDED and "destination" in str(err)
    pd.assert_idle_accounting()
