"""Conditional disaggregation on D: requests with no prefill leg (``DecodeRequest.local_prefill``).

The router sends a request to D alone when D's radix cache holds all but a short tail of the prompt
(a follow-up turn of a chat) or every prefill worker is busy (docs/architecture.md, A request's
path). D then does what the resume of a retracted request does (``decode_svc.memory``): admit the
prompt against its radix cache (at most ``len - 1`` tokens matched, so the last token's logits are
computed here), recompute the uncached tail with EXTEND forwards on its own runner, and sample the
first token itself with the request's sampler (the same ``engine.sampler.sample`` call P makes:
logit_bias, grammar, penalties, seed, logprobs), after which the job joins the running batch
exactly like one whose KV P sent.

**Interleaved, not mixed:** each scheduler iteration runs at most one EXTEND forward here (every
computing request's next chunk, ``chunk_tokens`` in all, the engine's ``--chunked-prefill-size``),
then the decode step of the running batch; a long tail therefore delays each decode step by one
chunk's compute, never by the whole tail.

Admission is FIFO with the same reserve and projected headroom as a PD request
(``decode_svc.prealloc``); nothing is sent to any P, so nothing of this path is ever quarantined.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from decode_svc.jobs import DecodeJob, JobState
from decode_svc.memory import DecodeMemory
from decode_svc.page_checksums import PageChecksums
from engine.extend_chunks import extend_batch, next_chunks
from engine.kvcache.cache_manager import CacheManager
from engine.sampler import make_generator, sample
from pd_common.protocol import token_logprob
from protos import common_pb2
from telemetry import metrics as M

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

log = logging.getLogger("halfmoon.decode")

# starts a job whose prompt K/V is whole: (job, first token, its TokenLogprob or None)
Start = Callable[[DecodeJob, int, "common_pb2.TokenLogprob | None"], None]


class LocalPrefillQueue:
    """LOCAL_PREFILL jobs: waiting for a lease (FIFO), then computing their tail (scheduler thread only).

    Args:
        runner: D's ModelRunner (the EXTEND forwards, the samplers' device).
        kv: D's CacheManager.
        memory: reserve sizes and the projected headroom (shared with PD admission).
        live: every live job (for the projection).
        chunk_tokens: most prompt tokens computed per iteration across all jobs (>= 1).
        page_sums: verifies a prefix hit's pages before they are reused (None: not checked).
    """

    def __init__(self, runner: ModelRunner, kv: CacheManager, memory: DecodeMemory,
                 live: Callable[[], Iterable[DecodeJob]], *, chunk_tokens: int,
                 page_sums: PageChecksums | None = None):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.runner = runner
        self.kv = kv
        self.memory = memory
        self._live = live
        self.chunk_tokens = chunk_tokens
        self.page_sums = page_sums
        self._queue: collections.deque[DecodeJob] = collections.deque()
        self.computing: list[DecodeJob] = []  # leased; ``kv_len`` = prompt tokens whose K/V the row holds

    def __len__(self) -> int:
        return len(self._queue) + len(self.computing)

    def jobs(self) -> list[DecodeJob]:
        return list(self._queue) + self.computing

    def add(self, job: DecodeJob) -> None:
        job.state = JobState.LOCAL_PREFILL
        self._queue.append(job)

    def discard(self, job: DecodeJob) -> None:
        """Forget an ended job; its lease (if any) is the caller's to release (``job.release_kv``:
        the radix cache keeps the full pages computed so far)."""
        if job in self._queue:
            self._queue.remove(job)
        if job in self.computing:
            self.computing.remove(job)

    def step(self, admit: bool, settle: Callable[[], None], start: Start) -> None:
        """One EXTEND forward over the computing jobs' next chunks (admitting new ones from the head
        while ``admit``, rows and pages allow), then ``start`` each job whose prompt is complete.
        ``settle`` completes the decode step in flight before the runner runs another forward."""
        budget = self.chunk_tokens
        while admit and self._queue and sum(len(j.prompt_ids) - j.kv_len for j in self.computing) < budget:
            if not self._admit(self._queue[0]):
                break
            self.computing.append(self._queue.popleft())
        toks = next_chunks([j.prompt_ids for j in self.computing], [j.kv_len for j in self.computing], budget)
        jobs = self.computing[:len(toks)]
        if not jobs:
            return
        settle()
        batch = extend_batch(self.kv.r2t.req_to_token, [j.lease.row for j in jobs], [j.kv_len for j in jobs],
                             toks, self.runner.device)
        logits = self.runner.forward(batch)
        M.DECODE_LOCAL_PREFILL_TOKENS.inc(sum(len(t) for t in toks))
        done = []
        for i, (job, t) in enumerate(zip(jobs, toks)):
            job.kv_len += len(t)
            if job.kv_len == len(job.prompt_ids):
                done.append((i, job))
        if done:
            self._first_tokens(logits[[i for i, _ in done]], [j for _, j in done], start)

    def _admit(self, job: DecodeJob) -> bool:
        """A lease for the prompt (radix match of at most ``len - 1`` tokens) plus the reserve."""
        n, mt = len(job.prompt_ids), job.params.max_tokens
        while True:
            held = self.memory.reserve_len(n, mt)
            others, any_lease = self.memory.headroom(self._live())
            head = others + self.memory.new_future_pages(n, mt, held) if any_lease else 0
            lease = self.kv.admit(job.prompt_ids, match_len=n - 1, alloc_len=held, headroom_pages=head)
            # a bad cached page left the tree with what follows it: the next match is shorter
            if lease is None or self.page_sums is None or not self.page_sums.cut_bad_prefix(
                    self.kv, lease, job.prompt_ids):
                break
        if lease is None:
            return False
        job.lease = lease
        job.kv_len = lease.pre_len
        job.cached_tokens = lease.pre_len  # no P leg: the tokens not computed are D's hit
        M.DECODE_PROMPT_TOKENS.inc(n)
        M.DECODE_PREFIX_HIT_TOKENS.inc(lease.pre_len)
        M.DECODE_LOCAL_PREFILLS.inc()
        log.debug("local prefill room=%d len=%d pre_len=%d", job.room, n, lease.pre_len)
        return True

    def _first_tokens(self, logits: torch.Tensor, done: list[DecodeJob], start: Start) -> None:
        """Sample each finished job's first token as P would (a fresh seeded generator, the grammar's
        matcher, logprobs), commit its prompt's pages and hand it to the running batch."""
        gens = [make_generator(j.params.seed, self.runner.device) if not j.params.greedy else None for j in done]
        out = sample(logits, [j.params for j in done], gens, [j.prompt_ids for j in done],
                     [[] for _ in done], [j.grammar for j in done])
        for k, job in enumerate(done):
            self.computing.remove(job)
            job.generator = gens[k]  # the same random stream P would have handed on
            self.kv.commit(job.lease, job.prompt_ids)
            lp = None
            if job.params.logprobs or job.params.top_logprobs:
                lp = token_logprob(out.token_ids[k], out.logprobs[k], out.top_logprobs[k])
            start(job, out.token_ids[k], lp)
