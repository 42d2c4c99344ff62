"""Chunked prefill: one extend batch per iteration over the jobs still computing their prompt.

The batch takes the next tokens of each prefilling job in admission order until the chunk budget
(``chunked_prefill_size`` tokens) is spent, so a long prompt is computed over several iterations
while short ones behind it still get a share. A job whose prompt is complete samples its first
output token from the batch's logits (n first tokens, one per sample, when ``PrefillRequest.n > 1``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine.extend_chunks import extend_batch, next_chunks
from engine.sampler import make_generator, sample
from engine.sampling_params import for_sample
from pd_common.protocol import token_logprob
from prefill_svc.jobs import FirstToken, JobState, PrefillJob
from protos import prefill_pb2
from telemetry import metrics as M

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner


class ChunkedPrefill:
    """Owns the ``PREFILLING`` jobs (admission order) and runs their forwards.

    Args:
        runner: P's model runner (its pool holds the jobs' KV).
        chunk_tokens: most prompt tokens in one extend batch.
    """

    def __init__(self, runner: ModelRunner, chunk_tokens: int):
        self.runner = runner
        self.chunk_tokens = chunk_tokens
        self.prefilling: list[PrefillJob] = []

    def add(self, job: PrefillJob) -> None:
        self.prefilling.append(job)

    def discard(self, job: PrefillJob) -> None:
        if job in self.prefilling:
            self.prefilling.remove(job)

    def step(self) -> None:
        """Run one extend batch (nothing when no job is prefilling). Jobs whose prompt is complete
        get ``first`` (and ``rng_state`` when seeded), leave the prefilling list and become
        ``TRANSFERRING`` (a destination is known) or ``WAIT_DEST``."""
        toks = next_chunks([j.prompt_ids for j in self.prefilling], [j.computed for j in self.prefilling],
                           self.chunk_tokens)
        jobs = self.prefilling[:len(toks)]
        if not jobs:
            return
        batch = extend_batch(self.runner.req_to_token_pool.req_to_token, [j.lease.row for j in jobs],
                             [j.computed for j in jobs], toks, self.runner.device)
        t0 = time.monotonic()
        logits = self.runner.forward(batch)
        M.PREFILL_COMPUTE_SECONDS.observe(time.monotonic() - t0)
        M.PREFILL_BATCH_SIZE.observe(len(jobs))
        M.PREFILL_BATCH_TOKENS.observe(sum(len(t) for t in toks))
        done = []
        for i, (job, t) in enumerate(zip(jobs, toks)):
            job.computed += len(t)
            if job.computed == len(job.prompt_ids):
                done.append((i, job))
        if done:
            self._sample_first(logits[[i for i, _ in done]], [j for _, j in done])

    def _sample_first(self, logits: torch.Tensor, done: list[PrefillJob]) -> None:
        # one row per sample: a job with n samples repeats its logits row n times, sample i with its
        # own generator (seed + i) and matcher, so sample i equals an n=1 request with seed + i
        owners = [(job, i) for job in done for i in range(job.n)]
        rows = [k for k, job in enumerate(done) for _ in range(job.n)]
        params = [for_sample(job.params, i) for job, i in owners]
        # generators on the logits' device: torch.multinomial needs them there
        gens = [make_generator(p.seed, self.runner.device) if not p.greedy else None for p in params]
        grammars = [job.grammar if i == 0 or job.grammar is None else job.sample_grammars[i - 1]
                    for job, i in owners]
        out = sample(logits[rows], params, gens, [job.prompt_ids for job, _ in owners],
                     [[] for _ in owners], grammars)
        for r, (job, i) in enumerate(owners):
            state = bytes(gens[r].get_state().numpy().tobytes()) if gens[r] is not None else b""
            if i:  # D continues each sample's random stream from this state
                lp = token_logprob(out.token_ids[r], out.logprobs[r], out.top_logprobs[r])
                job.samples.append(prefill_pb2.FirstSample(token_id=out.token_ids[r], logprob=lp,
                                                           sampler_state=state))
                continue
            job.first = FirstToken(out.token_ids[r], out.logprobs[r], out.top_logprobs[r])
            job.rng_state = state
            job.t_prefilled = time.monotonic()
            job.state = JobState.TRANSFERRING if job.dest is not None else JobState.WAIT_DEST
            self.prefilling.remove(job)
