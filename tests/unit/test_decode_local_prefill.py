"""D prefills a request itself (``DecodeRequest.local_prefill``, decode_svc/local_prefill.py), in the
scheduler harness tests/unit/decode_harness.py (tiny random model, no P): nothing goes to any P, the
tokens equal the co-located engine's, the tail's EXTEND chunks are interleaved with the running
batch's decode steps, and an abort mid-tail leaves exact accounting."""

from __future__ import annotations

import grpc

from decode_svc.jobs import DecodeJob, JobState
from engine.sampling_params import SamplingParams
from telemetry import metrics as M
from tests.unit.decode_harness import PROMPT, Decode, chunks, code, model, outcome, reference  # noqa: F401


def submit_local(d: Decode, ids, max_tokens=6) -> DecodeJob:
    job = DecodeJob(request_id=f"local-{len(d.jobs)}", room=1000 + len(d.jobs), prompt_ids=list(ids),
                    params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                    prefill_address="", local_prefill=True)
    d.jobs.append(job)
    d.sched.submit(job)
    return job


def local_tokens() -> float:
    return M.DECODE_LOCAL_PREFILL_TOKENS._value.get()


def test_follow_up_is_computed_on_d_and_equals_the_colocated_engine(model, reference):
    d = Decode(model, checksums=True)
    d.serve(PROMPT, 3, reference, checksums=True)  # 10 + 2 tokens: 3 full pages cached
    follow = PROMPT + reference(PROMPT, 3)[:2] + [3, 44, 51]  # 15 tokens, 12 cached
    before, dests = local_tokens(), dict(d.net.dests)
    job = submit_local(d, follow, 5)
    d.run_until_done(job)
    got, end = chunks(job)
    assert end is None and [c.token_ids[0] for c in got] == reference(follow, 5)
    first = got[0]
    assert (first.decode_prefix_tokens, first.cached_tokens, first.kv_pages_transferred) == (12, 12, 0)
    assert local_tokens() - before == 3
    assert d.net.dests == dests and d.net.aborts == []  # no P was asked anything
    d.assert_idle()


def test_full_hit_recomputes_the_last_page_and_no_hit_the_whole_prompt(model, reference):
    d = Decode(model)
    prompt = PROMPT[:8]
    d.serve(prompt, 2, reference)
    full = submit_local(d, prompt, 4)  # D holds both pages; the last token's logits need a forward
    fresh = submit_local(d, [7, 7, 1, 90, 4, 4, 23], 4)
    d.run_until_done(full, fresh)
    assert outcome(full) == (reference(prompt, 4), None) and full.lease is None
    assert outcome(fresh) == (reference([7, 7, 1, 90, 4, 4, 23], 4), None)
    d.assert_idle()


def test_tail_chunks_interleave_with_decode_steps(model, reference):
    d = Decode(model, resume_chunk_tokens=4)
    ref_run = reference(PROMPT, 16)
    run = d.submit(PROMPT, 16)
    d.tick()
    d.prefill(run, ref_run[0])
    d.tick(2)
    assert run.state is JobState.RUNNING
    long = [(5 * k + 1) % 96 for k in range(22)]  # nothing of it cached
    job = submit_local(d, long, 4)
    progress = []
    for _ in range(4):
        n_run = len(run.output_ids)
        d.tick()
        progress.append((job.kv_len, len(run.output_ids) - n_run))
    # 4 prompt tokens per iteration (the chunk), and a decode step for the running request each time
    assert [k for k, _ in progress[:3]] == [4, 8, 12] and all(step == 1 for _, step in progress)
    d.run_until_done(run, job)
    assert outcome(run) == (ref_run, None) and outcome(job) == (reference(long, 4), None)
    d.assert_idle()


def test_abort_mid_tail_keeps_exact_accounting(model, reference):
    d = Decode(model, resume_chunk_tokens=4)
    job = submit_local(d, [int(t) for t in (PROMPT * 2)[:18]], 4)
    d.tick(2)
    assert job.state is JobState.LOCAL_PREFILL and job.kv_len == 8
    assert d.load().waiting_requests == 1
    d.sched.abort(job.room, job.request_id, "client went away")
    d.tick()
    toks, end = outcome(job)
    assert toks == [] and code(end) is grpc.StatusCode.CANCELLED
    d.assert_idle()
    assert d.load().accounting.evictable_pages == 2  # the two pages computed so far stay cached
