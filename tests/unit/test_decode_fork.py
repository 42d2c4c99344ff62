"""D forks an n > 1 request into its samples after P's KV is committed (decode_svc/fork.py).

Same harness as test_decode_scheduler (a tiny random-weight model, the test plays P): one notice
with n first tokens; the prompt's full pages are shared under one lock ref per sample, the partial
last page is copied per sample, each sample owns its decode pages. One sample finishing, aborted or
retracted leaves the others; an abort of the request ends all. Accounting exact after each.
"""

from __future__ import annotations

import queue

import grpc
import pytest
import torch

from decode_svc.jobs import DecodeJob, JobState
from decode_svc.streams import stream_chunks
from engine.sampling_params import SamplingParams, sample_seed
from engine.errors import InvalidRequestError
from pd_common.protocol import MAX_SAMPLES, ServiceError, validate_samples
from protos import decode_pb2, prefill_pb2
from telemetry import metrics as M
from tests.unit.test_decode_scheduler import P_ADDR, PROMPT, PS, Decode, model, reference  # noqa: F401

SEED = 77


def submit(d: Decode, n: int, max_tokens: int, **sampling) -> DecodeJob:
    sampling.setdefault("temperature", 0)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    job = DecodeJob(request_id=f"req-{len(d.jobs)}", room=1000 + len(d.jobs), prompt_ids=list(PROMPT),
                    params=params, prefill_address=P_ADDR, n=n)
    d.jobs.append(job)
    d.sched.submit(job)
    return job


def play_p(d: Decode, job: DecodeJob, firsts: list[int], states: list[bytes] | None = None) -> None:
    """P's prefill of ``job`` with n first tokens (sample i's sampler state ``states[i]``)."""
    states = states or [b""] * len(firsts)
    d.prefill(job, firsts[0], sampler_state=states[0],
              samples=[prefill_pb2.FirstSample(token_id=t, sampler_state=s)
                       for t, s in zip(firsts[1:], states[1:])])


def by_index(job: DecodeJob) -> tuple[dict[int, list[decode_pb2.DecodeChunk]], object]:
    """(chunks per sample, end) read from the request's one stream queue."""
    out, end = {}, "open"
    while not job.out.empty():
        item = job.out.get()
        if item is None or isinstance(item, ServiceError):
            end = item
        else:
            out.setdefault(item.index, []).append(item)
    return out, end


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def samples(d: Decode, job: DecodeJob) -> list[DecodeJob]:
    return d.sched.forks._forks[job].samples


def test_fork_shares_full_pages_under_lock_refs_and_copies_the_last_page(model, reference):
    d = Decode(model)
    ref = reference(PROMPT, 6)
    job = submit(d, 3, 6)
    d.tick(2)
    assert len(d.net.dests[job.room].dst_page_ids) == 3   # the prompt's pages move once
    play_p(d, job, [ref[0]] * 3)
    d.tick()
    assert job.state is JobState.FORKED and job.lease is None
    ss = samples(d, job)
    assert [s.index for s in ss] == [0, 1, 2]
    r2t = d.runner.req_to_token_pool.req_to_token
    rows = [r2t[s.lease.row, :len(PROMPT)] // PS for s in ss]
    shared = rows[0][:8:PS].tolist()
    assert all(r[:8:PS].tolist() == shared for r in rows)            # 2 full pages, shared
    last = [int(r[8]) for r in rows]
    assert len(set(last)) == 3                                        # the partial page: one each
    node = ss[0].lease.node
    assert all(s.lease.node is node for s in ss) and node.lock_ref == 3
    pool = d.runner.kv_pool
    for s in ss[1:]:   # the copy holds P's K/V of tokens 8, 9 (every layer)
        for layer in range(pool.num_layers):
            assert torch.equal(pool.k_pages(layer)[last[0], :2], pool.k_pages(layer)[s.lease.own_pages[0], :2])
            assert torch.equal(pool.v_pages(layer)[last[0], :2], pool.v_pages(layer)[s.lease.own_pages[0], :2])
    d.run_until_done(*ss)
    got, end = by_index(job)
    assert end is None and job.state is JobState.DONE
    assert {i: tokens(c) for i, c in got.items()} == {0: ref, 1: ref, 2: ref}
    assert [c[-1].finish_reason for c in got.values()] == ["length"] * 3
    assert [c[0].kv_pages_transferred for c in got.values()] == [3, 0, 0]   # counted once
    assert [c[0].decode_prefix_tokens for c in got.values()] == [0, 8, 8]
    d.assert_idle()


def test_seeded_sample_i_continues_its_own_generator(model):
    """Sample i of a seeded n=3 request decodes what an n=1 request with seed + i does, given
    P's first token and generator state for each."""
    def state(seed):
        g = torch.Generator()
        g.manual_seed(seed)
        torch.rand(3, generator=g)   # P drew from it
        return bytes(g.get_state().numpy().tobytes())

    seeds = [sample_seed(SEED, i) for i in range(3)]
    d = Decode(model)
    job = submit(d, 3, 8, temperature=1.0, seed=SEED)
    d.tick(2)
    play_p(d, job, [7, 8, 9], [state(s) for s in seeds])
    d.tick()
    d.run_until_done(*samples(d, job))
    got, end = by_index(job)
    assert end is None
    singles = []
    for i, seed in enumerate(seeds):
        one = submit(d, 1, 8, temperature=1.0, seed=seed)
        d.tick(2)
        play_p(d, one, [7 + i], [state(seed)])
        d.run_until_done(one)
        singles.append(tokens(by_index(one)[0][0]))
    assert [tokens(got[i]) for i in range(3)] == singles
    assert len({tuple(t) for t in singles}) == 3
    d.assert_idle()


def test_a_sample_that_finishes_first_frees_only_its_pages(model, reference):
    d = Decode(model)
    ref = reference(PROMPT, 8)
    stop = (ref[0] + 1) % 96
    job = submit(d, 3, 8, stop_token_ids=[stop])
    d.tick(2)
    play_p(d, job, [ref[0], stop, ref[0]])
    d.tick()
    ss = samples(d, job)
    assert ss[1].state is JobState.DONE and ss[1].lease is None        # ended on its first token
    assert ss[0].lease.node.lock_ref == 2
    d.run_until_done(ss[0], ss[2])
    got, end = by_index(job)
    assert end is None and tokens(got[1]) == [stop] and got[1][-1].finish_reason == "stop"
    assert tokens(got[0]) == tokens(got[2]) == ref
    d.assert_idle()


def test_abort_of_one_sample_then_of_the_request(model, reference):
    d = Decode(model)
    ref = reference(PROMPT, 20)
    job = submit(d, 3, 20)
    d.tick(2)
    play_p(d, job, [ref[0]] * 3)
    d.tick(3)
    ss = samples(d, job)
    owned = d.load().accounting.owned_pages
    d.sched.abort(job.room, job.request_id, "one", sample=1)
    d.tick()
    assert ss[1].state is JobState.DONE and ss[0].lease.node.lock_ref == 2
    assert d.load().accounting.owned_pages < owned                      # its own pages only
    assert all(s.state is JobState.RUNNING for s in (ss[0], ss[2]))
    d.tick(2)
    d.sched.abort(job.room, job.request_id, "all")
    d.tick()
    got, end = by_index(job)
    assert isinstance(end, ServiceError) and end.code is grpc.StatusCode.CANCELLED
    assert got[1][-1].finish_reason == "abort" and tokens(got[1]) == ref[:len(tokens(got[1]))]
    assert all(s.state is JobState.DONE for s in ss) and job.state is JobState.DONE
    for i in (0, 2):
        assert len(tokens(got[i])) > len(tokens(got[1])) and tokens(got[i]) == ref[:len(tokens(got[i]))]
    d.assert_idle()


def test_a_retracted_sample_resumes_and_the_others_keep_their_pages(model, reference):
    d = Decode(model, num_pages=10, reserved_decode_tokens=2)
    ref = reference(PROMPT, 20)
    before = sum(M.DECODE_RETRACTIONS.labels(reason=r)._value.get() for r in ("newest", "pinned"))
    job = submit(d, 3, 20)
    d.tick(2)
    play_p(d, job, [ref[0]] * 3)
    ss = None
    for _ in range(200):
        d.tick()
        ss = ss or samples(d, job)
        if job.state is JobState.DONE:
            break
    got, end = by_index(job)
    after = sum(M.DECODE_RETRACTIONS.labels(reason=r)._value.get() for r in ("newest", "pinned"))
    assert after > before and any(s.retractions for s in ss)
    assert end is None and {i: tokens(c) for i, c in got.items()} == {0: ref, 1: ref, 2: ref}
    d.assert_idle()


def test_n_above_the_bound_is_refused_by_name():
    assert validate_samples(0) == 1 and validate_samples(MAX_SAMPLES) == MAX_SAMPLES
    with pytest.raises(InvalidRequestError) as e:
        validate_samples(MAX_SAMPLES + 1)
    assert e.value.field == "n"


def test_stream_coalesces_per_sample_never_across():
    q = queue.SimpleQueue()
    for i in (0, 1, 0, 2, 1):
        q.put(decode_pb2.DecodeChunk(token_ids=[10 + i], index=i))
    q.put(None)
    sent = list(stream_chunks(q, keepalive_s=0, queued=lambda: False))
    assert [(c.index, list(c.token_ids)) for c in sent] == [(0, [10, 10]), (1, [11, 11]), (2, [12])]


def test_without_radix_cache_each_sample_copies_the_prompt(model, reference):
    d = Decode(model, disable_radix_cache=True)
    ref = reference(PROMPT, 6)
    job = submit(d, 2, 6)
    d.tick(2)
    play_p(d, job, [ref[0]] * 2)
    d.tick()
    ss = samples(d, job)
    assert ss[1].lease.pre_len == 0 and len(set(ss[0].lease.own_pages) & set(ss[1].lease.own_pages)) == 0
    d.run_until_done(*ss)
    got, end = by_index(job)
    assert end is None and [tokens(got[i]) for i in range(2)] == [ref, ref]
    d.assert_idle()
    assert d.load().accounting.free_pages == d.load().accounting.total_pages


def test_a_sample_without_pages_at_the_fork_streams_its_first_token_and_resumes(model, reference):
    d = Decode(model, num_pages=4, reserved_decode_tokens=2)
    ref = reference(PROMPT, 3)
    job = submit(d, 3, 3)
    d.tick(2)
    play_p(d, job, [ref[0]] * 3)
    d.tick()
    ss = samples(d, job)
    assert [s.lease is not None for s in ss] == [True, True, False]   # one free page for sample 1 only
    assert ss[2].state is JobState.RETRACTED and ss[2].output_ids == [ref[0]]
    d.run_until_done(*ss, limit=200)
    got, end = by_index(job)
    assert end is None and [tokens(got[i]) for i in range(3)] == [ref] * 3
    assert ss[2].retractions == 0   # waited, was not retracted
    d.assert_idle()


def test_overlap_schedule_forks_and_frees_an_aborted_sample_after_its_step(model, reference):
    d = Decode(model, overlap_schedule=True)
    ref = reference(PROMPT, 12)
    job = submit(d, 3, 12)
    d.tick(2)
    play_p(d, job, [ref[0]] * 3)
    d.tick(3)
    assert d.sched.running.overlap.busy   # the samples' next step is in flight
    d.sched.abort(job.room, job.request_id, "one", sample=2)
    d.sched.inbox.drain(0, d.sched.handle)
    assert d.sched.running.overlap.deferred_pages > 0   # its pages wait for the step writing them
    d.run_until_done(*samples(d, job))
    got, end = by_index(job)
    assert end is None and tokens(got[0]) == tokens(got[1]) == ref
    assert got[2][-1].finish_reason == "abort" and tokens(got[2]) == ref[:len(tokens(got[2]))]
    d.assert_idle()


def test_a_sample_abort_before_the_fork_and_out_of_range_ones(model, reference):
    d = Decode(model)
    ref = reference(PROMPT, 6)
    one = submit(d, 1, 6)
    job = submit(d, 2, 6)
    d.tick(2)
    for j in (one, job):   # an n=1 request has no sample 1; no request has a sample 2
        d.sched.abort(j.room, j.request_id, "nothing to end", sample=2)
    d.sched.abort(one.room, one.request_id, "nothing to end", sample=1)
    d.sched.abort(job.room, job.request_id, "before the fork", sample=1)   # still in the KV wait
    d.tick()
    assert one.state is JobState.TRANSFER and job.state is JobState.TRANSFER
    play_p(d, one, [ref[0]])
    play_p(d, job, [ref[0]] * 2)
    d.tick()
    d.run_until_done(one, job)
    got, end = by_index(job)
    assert end is None and tokens(got[0]) == ref
    assert [(c.finish_reason, list(c.token_ids)) for c in got[1]] == [("abort", [])]
    got, end = by_index(one)
    assert end is None and tokens(got[0]) == ref
    d.assert_idle()


class _FollowerGroup:
    """D's TPGroup with one follower (rank 1) whose pool the test keeps: commands applied in order."""

    size = 2

    def __init__(self, pool):
        from pd_common.tp_rank import WriteAgent

        self.commands: list[tuple[int, bytes]] = []
        self.agent = WriteAgent.__new__(WriteAgent)  # only its D-side commands (no transfer engine)
        self.agent.runner = type("R", (), {"kv_pool": pool})()
        self.agent.me = type("Me", (), {"rank": 1})()
        self.agent.group = self

    def send_command(self, rank, payload):
        self.commands.append((rank, payload))
        self.agent.handle(payload)


def test_under_tp_every_rank_copies_its_heads_of_the_partial_last_page(model, reference):
    # each rank holds only its kv heads of a page: a fork that copies the last page on rank 0 alone
    # leaves sample 1.. reading whatever a follower's page held before (wrong tokens on D --tp 2)
    from engine.kvcache.kv_pool import KVPool

    d = Decode(model)
    pool = d.runner.kv_pool
    follower = KVPool(pool.num_pages, pool.page_size, pool.num_layers, 1, pool.head_dim, pool.dtype)
    for buf in follower.buffers():
        buf.copy_(torch.arange(buf.numel(), dtype=buf.dtype).view_as(buf))  # every page distinct
    group = d.sched.forks.group = _FollowerGroup(follower)
    ref = reference(PROMPT, 6)
    job = submit(d, 3, 6)
    d.tick(2)
    play_p(d, job, [ref[0]] * 3)
    d.tick()
    ss = samples(d, job)
    assert [r for r, _ in group.commands] == [1, 1]   # one copy per sample 1.., to the follower
    last = ss[0].lease.own_pages[0]
    for s in ss[1:]:
        for layer in range(pool.num_layers):
            assert torch.equal(follower.k_pages(layer)[last], follower.k_pages(layer)[s.lease.own_pages[0]])
            assert torch.equal(follower.v_pages(layer)[last], follower.v_pages(layer)[s.lease.own_pages[0]])
    d.run_until_done(*ss)
    by_index(job)
    d.assert_idle()
