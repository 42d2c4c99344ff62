"""P's side of the write fence (docs/architecture.md, Fencing one-sided writes): no batch or ok
notice starts after the destination's write window or while P's own lease view has lapsed; D gets
exactly one ok=false notice instead."""

from __future__ import annotations

import time

import grpc

from protos import prefill_pb2
from tests.unit.prefill_harness import error_of, model, pair, prompt  # noqa: F401


def _fenced_once(pd, room, ids, code, why):
    err = error_of(pd.submit(ids, room))
    assert err.code is code and why in str(err), err
    (notice,) = pd.notices()
    assert not notice.ok and notice.room == room and why in notice.error
    pd.no_more_notices()
    assert pd.batches(room) == []  # nothing was written into D's pages
    pd.assert_idle_accounting()


def test_no_write_after_the_window(pair):
    pd = pair()
    ids, room = prompt(5, 40), 31
    dest = pd.destination(room, len(ids), write_deadline_ms=500)
    dest.not_after = time.monotonic() - 0.01  # received long ago (a stopped P resuming)
    pd.offer(dest)
    _fenced_once(pd, room, ids, grpc.StatusCode.DEADLINE_EXCEEDED, "write window")


def test_no_write_while_the_lease_has_lapsed(pair):
    pd = pair()
    pd.sched.sender.lease_valid_for = lambda: -3.0
    pd.sched.sender.lease_fence_margin_s = 1.0
    ids, room = prompt(6, 40), 32
    dest = pd.destination(room, len(ids), write_deadline_ms=30_000)
    dest.not_after = time.monotonic() + 30
    pd.offer(dest)
    _fenced_once(pd, room, ids, grpc.StatusCode.UNAVAILABLE, "registry lease")
    pd.sched.sender.lease_valid_for = lambda: 10.0  # renewed: writes go again
    ids, room = prompt(7, 40), 33
    pd.offer(pd.destination(room, len(ids)))
    res = pd.submit(ids, room).reply.result(timeout=30)
    assert res.pages_sent == len(pd.batches(room)[0]["dst_pages"]) and pd.notices()[0].ok
    assert isinstance(res, prefill_pb2.PrefillResult)
