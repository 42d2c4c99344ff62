"""D's on-demand decode memory in one process: reserve, growth, retraction and resume.

The tiny model and stub P of ``tests/unit/decode_harness.py``, with pools too small for the requests'
whole lengths, so requests grow page by page and the pool runs short at decode steps. Every
request's greedy tokens must equal the co-located engine's run of it alone, the stream must have no
gap or repeated token, and after every scenario the accounting is exact (free + evictable + locked +
owned == pool, no lock, row or room held).
"""

from __future__ import annotations

import grpc
import pytest

from decode_svc.jobs import JobState
from engine.forward_batch import ForwardMode
from engine.sampling_params import SamplingParams
from engine.scheduler.retraction import NewTokenRatio, pick_victim
from protos import prefill_pb2
from telemetry import metrics as M
from tests.unit.decode_harness import Decode, code, model, outcome, reference  # noqa: F401

PROMPTS = [[5, 17, 33, 2, 41, 8, 60, 12, 9, 70], [7, 3, 19, 44, 2, 61, 5], [30, 31, 32, 33, 34, 35],
           [11, 22, 33, 44, 55, 66, 77, 88, 9]]


def retractions() -> float:
    return sum(M.DECODE_RETRACTIONS.labels(reason=r)._value.get() for r in M.RETRACTION_REASONS)


def tight(d: Decode) -> Decode:
    """Admission projects almost nothing: requests are admitted as soon as their reserve fits, so
    the pool runs short at decode steps."""
    d.sched.memory.ratio = NewTokenRatio(init=0.01, floor=0.01)
    return d


def drive(d: Decode, jobs, firsts, limit=400) -> None:
    """Tick until every job is done, playing P for each job as soon as its destination is out."""
    sent = set()
    for _ in range(limit):
        for j, first in zip(jobs, firsts):
            if j.state is JobState.TRANSFER and j.room in d.net.dests and j.room not in sent:
                d.prefill(j, first)
                sent.add(j.room)
        if all(j.state is JobState.DONE for j in jobs):
            d.tick()
            return
        d.tick()
    raise AssertionError(f"not done: {[j.state for j in jobs]}")


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_heavy_retraction_keeps_greedy_tokens(model, reference, radix, overlap):
    """4 requests of 25 new tokens in 14 pages (each ends at 9 pages): many retractions; every
    stream equals the request run alone, token for token."""
    d = Decode(model, num_pages=14, reserved_decode_tokens=2, disable_radix_cache=not radix,
               overlap_schedule=overlap)
    refs = [reference(p, 25) for p in PROMPTS]
    before, misses = retractions(), M.DECODE_RESERVE_MISSES._value.get()
    jobs = [d.submit(p, 25) for p in PROMPTS]
    drive(d, jobs, [r[0] for r in refs])
    assert retractions() - before >= 2
    assert M.DECODE_RESERVE_MISSES._value.get() - misses >= 1  # each retraction follows a miss
    assert max(j.retractions for j in jobs) >= 1
    for j, ref in zip(jobs, refs):
        assert outcome(j) == (ref, None), j.request_id
    d.assert_idle()


def test_a_request_retracted_max_retractions_times_is_pinned(model, reference):
    """With --max-retractions 1 under heavy retraction, no request is retracted twice while another
    running request can still be chosen: every second retraction of one request is counted as
    "pinned" (all candidates were), and every stream still equals the request run alone."""
    d = Decode(model, num_pages=14, reserved_decode_tokens=2, max_retractions=1)
    refs = [reference(p, 25) for p in PROMPTS]
    pinned0 = M.DECODE_RETRACTIONS.labels(reason="pinned")._value.get()
    jobs = [d.submit(p, 25) for p in PROMPTS]
    drive(d, jobs, [r[0] for r in refs])
    pinned = M.DECODE_RETRACTIONS.labels(reason="pinned")._value.get() - pinned0
    assert sum(j.retractions for j in jobs) >= 2
    assert sum(max(0, j.retractions - 1) for j in jobs) == pinned
    for j, ref in zip(jobs, refs):
        assert outcome(j) == (ref, None), j.request_id
    d.assert_idle()


def test_retraction_just_after_the_first_token(model, reference):
    """B's notice is committed while A needs a page the pool no longer has: B, the newest, is
    retracted at its first decode step, holding only P's first token, and resumes after A."""
    d = tight(Decode(model, num_pages=6, reserved_decode_tokens=1))
    ra, rb = reference(PROMPTS[0], 12), reference(PROMPTS[2], 6)
    a, b = d.submit(PROMPTS[0], 12), d.submit(PROMPTS[2], 6)  # a: 3 pages (11 slots), b: 2 (7 slots)
    d.tick(2)
    d.prefill(a, ra[0])
    for _ in range(20):
        d.tick()
        if a.kv_len == 16:  # 4 pages full: the next step needs a 5th
            break
    assert a.kv_len == 16 and d.sched.kv.alloc.num_free == 0
    d.prefill(b, rb[0])
    d.tick()
    assert b.state is JobState.RETRACTED and b.output_ids == [rb[0]] and b.retractions == 1
    drive(d, [a, b], [ra[0], rb[0]])
    assert outcome(a) == (ra, None) and outcome(b) == (rb, None)
    d.assert_idle()


def test_retraction_while_another_request_is_committed(model, reference):
    """C's notice is committed in the same iteration as a decode step that retracts B."""
    d = tight(Decode(model, num_pages=10, reserved_decode_tokens=1))
    refs = [reference(p, 14) for p in PROMPTS[:3]]
    jobs = [d.submit(p, 14) for p in PROMPTS[:3]]
    drive(d, jobs, [r[0] for r in refs])
    assert sum(j.retractions for j in jobs) >= 1
    for j, ref in zip(jobs, refs):
        assert outcome(j) == (ref, None)
    d.assert_idle()


def spy_forwards(d: Decode) -> list:
    """Record (mode, tokens) of every forward D's runner runs (the real forward still runs)."""
    seen, real = [], d.runner.forward

    def forward(batch):
        seen.append((batch.mode, int(batch.extend_lens.sum())))
        return real(batch)

    d.runner.forward = forward
    return seen


def test_resume_recompute_is_chunked(model, reference):
    """Without the radix cache a resume recomputes the whole sequence (10+ tokens); with a chunk of
    3 tokens it takes several iterations, each with at most 3 recomputed tokens and a decode step
    for the running batch, and every stream still equals the request run alone."""
    d = tight(Decode(model, num_pages=14, reserved_decode_tokens=2, disable_radix_cache=True,
                     resume_chunk_tokens=3))
    refs = [reference(p, 25) for p in PROMPTS]
    jobs = [d.submit(p, 25) for p in PROMPTS]
    seen = spy_forwards(d)
    sent, spans, interleaved = set(), 0, 0
    for _ in range(600):
        for j, r in zip(jobs, refs):
            if j.state is JobState.TRANSFER and j.room in d.net.dests and j.room not in sent:
                d.prefill(j, r[0])
                sent.add(j.room)
        if all(j.state is JobState.DONE for j in jobs):
            break
        seen.clear()
        d.tick()
        extend = [n for m, n in seen if m is ForwardMode.EXTEND]
        assert sum(extend) <= 3, seen  # one chunk budget per iteration, across resuming jobs
        if d.sched.memory.resuming:  # a tail still unfinished after this iteration
            spans += 1
            interleaved += any(m is ForwardMode.DECODE for m, _ in seen)
    d.tick()
    assert max(j.retractions for j in jobs) >= 1 and spans >= 3 and interleaved >= 1
    for j, ref in zip(jobs, refs):
        assert outcome(j) == (ref, None), j.request_id
    d.assert_idle()


def test_abort_while_the_tail_is_recomputed(model, reference):
    """A resuming request (lease held, tail half recomputed) is aborted: it ends CANCELLED with a
    prefix of its reference, the other finishes, and nothing stays held."""
    d = tight(Decode(model, num_pages=8, reserved_decode_tokens=1, disable_radix_cache=True,
                     resume_chunk_tokens=2))
    ra, rb = reference(PROMPTS[0], 20), reference(PROMPTS[1], 20)
    a, b = d.submit(PROMPTS[0], 20), d.submit(PROMPTS[1], 20)
    for _ in range(200):
        for j, r in ((a, ra), (b, rb)):
            if j.state is JobState.TRANSFER and j.room in d.net.dests and not j.cached_tokens:
                d.prefill(j, r[0], cached_tokens=1)
        d.tick()
        if b in d.sched.memory.resuming:
            break
    assert b in d.sched.memory.resuming and b.lease is not None and b.state is JobState.RETRACTED
    d.sched.abort(b.room, b.request_id, "client gone")
    d.tick()
    toks, end = outcome(b)
    assert code(end) is grpc.StatusCode.CANCELLED and toks == rb[:len(toks)] and b.lease is None
    assert not d.sched.memory.resuming
    d.run_until_done(a, limit=200)
    assert outcome(a) == (ra, None)
    d.assert_idle()


def test_abort_of_a_retracted_request(model, reference):
    d = tight(Decode(model, num_pages=8, reserved_decode_tokens=1))
    ra, rb = reference(PROMPTS[0], 20), reference(PROMPTS[1], 20)
    a, b = d.submit(PROMPTS[0], 20), d.submit(PROMPTS[1], 20)
    for _ in range(60):
        for j, r in ((a, ra), (b, rb)):
            if j.state is JobState.TRANSFER and j.room in d.net.dests and not j.cached_tokens:
                d.prefill(j, r[0], cached_tokens=1)
        d.tick()
        if b.state is JobState.RETRACTED:
            break
    assert b.state is JobState.RETRACTED and b.lease is None
    d.sched.abort(b.room, b.request_id, "client gone")
    d.tick()
    toks, end = outcome(b)
    assert code(end) is grpc.StatusCode.CANCELLED and toks == rb[:len(toks)]
    d.run_until_done(a)
    assert outcome(a) == (ra, None)
    d.assert_idle()


def test_seeded_sampling_continues_its_generator(model):
    """A seeded, sampled request retracted mid-decode streams what it streams unretracted."""
    def run(num_pages):
        d = tight(Decode(model, num_pages=num_pages, reserved_decode_tokens=1))
        jobs = [d.submit(p, 16) for p in PROMPTS[:3]]
        for k, j in enumerate(jobs):  # before the scheduler sees them
            j.params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234 + k, ignore_eos=True)
        drive(d, jobs, [3, 4, 5])
        d.assert_idle()
        return [outcome(j) for j in jobs], sum(j.retractions for j in jobs)

    calm, n0 = run(64)
    squeezed, n1 = run(11)
    assert n0 == 0 and n1 >= 1
    assert squeezed == calm


def test_full_mode_reserves_everything_and_never_retracts(model, reference):
    d = Decode(model, num_pages=14, decode_reserve="full")
    refs = [reference(p, 25) for p in PROMPTS]
    jobs = [d.submit(p, 25) for p in PROMPTS]
    d.tick()
    assert len(jobs[0].lease.own_pages) == d.sched.kv.pages_for(10 + 24)
    drive(d, jobs, [r[0] for r in refs])
    assert [j.retractions for j in jobs] == [0, 0, 0, 0]
    for j, ref in zip(jobs, refs):
        assert outcome(j) == (ref, None)
    d.assert_idle()


def test_never_fits_and_alone_exhausted(model, reference):
    d = Decode(model, num_pages=4, reserved_decode_tokens=8)
    assert "max_tokens (30)" in d.sched.never_fits(8, 30)  # 8 + 29 > 16 slots: refused up front
    assert d.sched.never_fits(8, 9) is None                 # 8 + 8 fits
    ref = reference(PROMPTS[2], 30)
    # past the server's up-front check (the scheduler is driven directly): 6 + 8 fits, 6 + 29 never
    # does; alone, it fails when the pool ends instead of hanging
    j = d.submit(PROMPTS[2], 30)
    drive(d, [j], [ref[0]])
    toks, end = outcome(j)
    assert code(end) is grpc.StatusCode.RESOURCE_EXHAUSTED and toks == ref[:len(toks)] and len(toks) == 11
    d.assert_idle()


def test_projection_defers_admission(model):
    """With running requests projected to need the pool, a new one waits in prealloc."""
    d = Decode(model, num_pages=16, reserved_decode_tokens=1)
    d.sched.memory.ratio = NewTokenRatio(init=1.0, floor=1.0, clip_tokens=1000)
    a = d.submit(PROMPTS[0], 40)  # alone: admitted whatever its projection
    d.tick()
    b = d.submit(PROMPTS[1], 40)
    d.tick(2)
    assert a.state is JobState.TRANSFER and b.state is JobState.PREALLOC
    assert M.DECODE_PROJECTED_PAGES._value.get() > 0
    d.sched.abort(a.room, a.request_id, "x")
    d.sched.abort(b.room, b.request_id, "x")
    d.tick()
    d.recv.send(prefill_pb2.KVNotice(room=a.room, ok=False))  # P's answer to the accepted destination
    d.tick()
    d.assert_idle()


def test_projection_learns_from_finishes(model, reference):
    """Two D's whose ratio decays to its target in one step each see one request finish after the
    same 3 tokens: on one it ran to its max_tokens (3), on the other it stopped at its 3rd of 40
    allowed. Then a request A of 40 tokens is pre-allocated and B of 40 arrives: where finishes used
    all they were allowed, A is still projected at the initial 0.7 x 40 tokens (7 pages beyond its 3)
    and B must wait; where they stopped early, A is projected at 3/40 and B is admitted at once."""
    ref = reference(PROMPTS[2], 3)

    def after_finish(max_tokens: int, **stop) -> bool:
        d = Decode(model, num_pages=16, reserved_decode_tokens=1, disable_radix_cache=True)
        ratio = d.sched.memory.ratio = NewTokenRatio(init=0.7, floor=0.05, decay_steps=1)
        share0 = M.DECODE_FINISHED_TOKEN_SHARE._sum.get()
        c = d.submit(PROMPTS[2], max_tokens, **stop)
        drive(d, [c], [ref[0]])
        assert len(c.output_ids) == 3
        share = 3 / max_tokens
        assert ratio.learned == pytest.approx(share) and ratio.value == pytest.approx(max(0.05, min(0.7, share)))
        assert M.DECODE_FINISHED_TOKEN_SHARE._sum.get() - share0 == pytest.approx(share)
        a = d.submit(PROMPTS[0], 40)
        d.tick()
        b = d.submit(PROMPTS[1], 40)
        d.tick(2)
        assert a.state is JobState.TRANSFER
        admitted = b.state is not JobState.PREALLOC
        d.sched.abort(a.room, a.request_id, "x")
        d.sched.abort(b.room, b.request_id, "x")
        d.tick()
        for j in (a, b):
            if j.room in d.net.dests:  # P's answer to each accepted destination
                d.recv.send(prefill_pb2.KVNotice(room=j.room, ok=False))
        d.tick(2)
        d.assert_idle()
        return admitted

    assert not after_finish(3)                                   # ran to length: share 1.0, ratio 0.7
    assert ref[2] not in ref[:2]                                 # so the stop id ends it at its 3rd token
    assert after_finish(40, stop_token_ids=[ref[2]])             # stopped: share 0.075, ratio 0.075


def test_learned_ratio_bounds_and_decay():
    """Finishes move the decay's target within [floor, init]; a retraction resets to init."""
    r = NewTokenRatio(init=0.6, floor=0.1, decay_steps=5, clip_tokens=100, ema_weight=0.5)
    assert r.target == 0.1
    assert r.on_finish(100, 100) == 1.0 and r.target == 0.6  # ran to max_tokens: stays at init
    for _ in range(20):
        r.step()
    assert r.value == pytest.approx(0.6)
    assert r.on_finish(5, 4000) == 0.05  # a chat that stopped at 5 of "the rest of the context" (clip 100)
    assert r.learned == pytest.approx(0.525)
    for _ in range(2):
        r.on_finish(5, 4000)  # 0.525 -> 0.2875 -> 0.16875
    for _ in range(20):
        r.step()
    assert r.value == pytest.approx(r.target) and 0.1 < r.target < 0.2
    for _ in range(20):
        r.on_finish(1, 4000)
    for _ in range(20):
        r.step()
    assert r.value == pytest.approx(0.1)  # the learned share is below the floor: the floor holds
    r.on_finish(100, 100)
    assert r.value == pytest.approx(r.target) and r.target > 0.1  # longer finishes lift the value at once
    r.on_retract()
    assert r.value == 0.6
    with pytest.raises(ValueError):
        NewTokenRatio(ema_weight=0)


def test_policy_victims_and_ratio():
    class R:
        def __init__(self, seq, n):
            self.seq, self.n = seq, n

    rs = [R(1, 0), R(2, 3), R(3, 0)]
    assert pick_victim(rs, arrival=lambda r: r.seq, retractions=lambda r: r.n, max_retractions=3) == (rs[2], "newest")
    rs[2].n = 3
    assert pick_victim(rs, arrival=lambda r: r.seq, retractions=lambda r: r.n, max_retractions=3)[0] is rs[0]
    rs[0].n = 3
    assert pick_victim(rs, arrival=lambda r: r.seq, retractions=lambda r: r.n, max_retractions=3) == (rs[2], "pinned")
    assert pick_victim([], arrival=id, retractions=id) == (None, "")
    r = NewTokenRatio(init=0.5, floor=0.1, decay_steps=4, clip_tokens=100)
    assert r.projected_tokens(1000) == 50
    for _ in range(10):
        r.step()
    assert r.value == pytest.approx(0.1) and r.projected_tokens(30) == 3
    r.on_retract()
    assert r.value == 0.5
    with pytest.raises(ValueError):
        NewTokenRatio(init=0.1, floor=0.5)
