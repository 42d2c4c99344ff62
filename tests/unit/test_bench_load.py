"""Load generator semantics: concurrency bound, request/time bounds, Poisson gaps, multi-turn history.

The target here is an in-process asyncio stand-in that records what it was sent; the thing under test
is the load generator's scheduling, not a server.
"""

import asyncio
import statistics
import time

import pytest

from bench.load import arrival_gaps, run_load
from bench.request import BenchRequest, RequestRecord
from bench.workloads import Session


class RecordingTarget:
    name = "recording"

    def __init__(self, service_s=0.01):
        self.service_s = service_s
        self.in_flight = 0
        self.max_in_flight = 0
        self.sent: list[BenchRequest] = []

    async def generate(self, req):
        self.sent.append(req)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        rec = RequestRecord(session_id=req.session_id, turn=req.turn, start=time.perf_counter())
        await asyncio.sleep(self.service_s)
        rec.chunk_times, rec.chunk_tokens = [time.perf_counter()], [1]
        rec.text = f"reply-{req.session_id}-{req.turn}"
        rec.ok, rec.finish_reason, rec.end = True, "length", time.perf_counter()
        self.in_flight -= 1
        return rec


def single(n):
    return [Session(i, [BenchRequest(prompt=f"p{i}", session_id=i)]) for i in range(n)]


def test_closed_loop_keeps_exactly_c_in_flight_and_sends_each_session_once():
    t = RecordingTarget()
    res = asyncio.run(run_load(t, single(20), concurrency=4))
    assert t.max_in_flight == 4
    assert sorted(r.prompt for r in t.sent) == sorted(f"p{i}" for i in range(20))
    assert len(res.records) == 20 and res.duration_s > 0


def test_max_requests_bounds_the_run():
    t = RecordingTarget()
    res = asyncio.run(run_load(t, single(20), concurrency=3, max_requests=7))
    assert len(t.sent) == 7 and len(res.records) == 7


def test_duration_bounds_the_run():
    t = RecordingTarget(service_s=0.05)
    res = asyncio.run(run_load(t, single(1000), concurrency=2, duration_s=0.3))
    assert 2 <= len(t.sent) < 1000
    assert all(r.start - res.t0 < 0.3 + 0.05 for r in res.records)  # nothing sent after the bound


def test_poisson_gaps_are_seeded_with_mean_one_over_rate():
    a, b = arrival_gaps(4.0, 20000, seed=1), arrival_gaps(4.0, 20000, seed=1)
    assert a == b and a != arrival_gaps(4.0, 20000, seed=2)
    assert statistics.fmean(a) == pytest.approx(0.25, rel=0.03)
    assert statistics.pstdev(a) == pytest.approx(0.25, rel=0.05)  # exponential: std == mean


def test_open_loop_respects_the_in_flight_cap():
    t = RecordingTarget(service_s=0.05)
    asyncio.run(run_load(t, single(12), request_rate=1000.0, concurrency=2, seed=0))
    assert len(t.sent) == 12 and t.max_in_flight == 2


def test_multi_turn_history_carries_the_actual_replies():
    sessions = [Session(s, [BenchRequest(messages=[{"role": "user", "content": f"u{s}{k}"}], session_id=s, turn=k)
                            for k in range(3)], chat=True) for s in range(2)]
    t = RecordingTarget()
    asyncio.run(run_load(t, sessions, concurrency=2))
    last = [r for r in t.sent if r.session_id == 1 and r.turn == 2][0]
    assert last.messages == [{"role": "user", "content": "u10"}, {"role": "assistant", "content": "reply-1-0"},
                             {"role": "user", "content": "u11"}, {"role": "assistant", "content": "reply-1-1"},
                             {"role": "user", "content": "u12"}]
    turns = [(r.session_id, r.turn) for r in t.sent]
    for s in range(2):
        assert [k for sid, k in turns if sid == s] == [0, 1, 2]


def test_bad_load_arguments_are_rejected():
    with pytest.raises(ValueError, match="concurrency"):
        asyncio.run(run_load(RecordingTarget(), single(1)))
    with pytest.raises(ValueError, match="request_rate"):
        asyncio.run(run_load(RecordingTarget(), single(1), request_rate=-1.0))
