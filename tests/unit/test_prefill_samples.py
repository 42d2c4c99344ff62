"""P samples n first tokens from one prompt's logits (``PrefillRequest.n``, prefill_svc/chunked_prefill.py):
one prefill, sample i with the seed ``seed + i``, so sample i equals an n=1 request with that seed;
the notice carries samples 1..n-1 (``KVNotice.samples``). Same harness as test_prefill_scheduler."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from prefill_svc.jobs import PrefillJob
from tests.unit.test_prefill_scheduler import model, pair, prompt  # noqa: F401  (fixtures)

SEED = 2**64 - 2   # sample 2's seed wraps to 0


def _job(ids, room: int, n: int, **params) -> PrefillJob:
    return PrefillJob(request_id=f"r{room}", room=room, prompt_ids=list(ids), n=n,
                      params=SamplingParams(max_tokens=4, **params))


def _run(pd, job: PrefillJob):
    pd.sched.submit(job)
    pd.offer(pd.destination(job.room, len(job.prompt_ids)))
    res = job.reply.result(10)
    (notice,) = pd.notices()
    return res, notice


def test_seeded_samples_equal_n1_requests_with_seed_plus_i(pair):
    pd = pair()
    ids = prompt(5, 13)
    res, notice = _run(pd, _job(ids, 31, 3, temperature=1.0, seed=SEED))
    assert len(notice.samples) == 2 and notice.first_token_id == res.first_token_id
    got = [(notice.first_token_id, notice.first_logprob.logprob, notice.sampler_state)]
    got += [(s.token_id, s.logprob.logprob, s.sampler_state) for s in notice.samples]
    for i, seed in enumerate((SEED, SEED + 1, 0)):
        _, single = _run(pd, _job(ids, 40 + i, 1, temperature=1.0, seed=seed))
        assert not single.samples
        assert got[i] == (single.first_token_id, single.first_logprob.logprob, single.sampler_state), i
    assert got[2][2] != got[0][2]   # each sample's own generator state goes to D
    pd.assert_idle_accounting()


def test_greedy_samples_share_the_argmax_and_one_prefill_computes_the_prompt(pair):
    pd = pair()
    ids = prompt(6, 10)
    res, notice = _run(pd, _job(ids, 51, 4, temperature=0.0))
    assert [s.token_id for s in notice.samples] == [res.first_token_id] * 3
    assert all(s.sampler_state == b"" for s in notice.samples)   # greedy: no generator
    assert notice.pages_sent == res.pages_sent == 3               # the prompt's pages, once
    pd.assert_idle_accounting()
