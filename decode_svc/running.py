"""The continuous decode batch: committed requests wait for a slot, then decode one token a step.

Every running request takes part in each step (one DECODE forward for the batch) and its token is
streamed as soon as the host has it. A request finishes on a stop token id, EOS (unless
``ignore_eos``), a stop string, ``max_tokens`` or the context window; the chunk that finishes it
(and the first one) carries the request's summary. Both lists keep arrival order, so the batch
order does not depend on when each request's KV came in.

Before each step every running request gets the slot its next token writes (``CacheManager.grow``;
with the overlap schedule the in-flight token's slot is already counted in ``kv_len``). When the
pool cannot give it, the step in flight is settled first (its finishes may free pages), then
victims are retracted (``decode_svc.memory``) until the request fits or is itself the victim.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from decode_svc.jobs import DecodeJob, JobState
from decode_svc.memory import DecodeMemory
from decode_svc.overlap import OverlapSchedule, overlappable
from decode_svc.step_clock import StepClock
from engine.forward_batch import ForwardBatch
from engine.kvcache.cache_manager import CacheManager
from engine.sampler import sample
from pd_common.protocol import token_logprob
from protos import common_pb2, decode_pb2
from telemetry import metrics as M

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner


def _by_arrival(job: DecodeJob) -> int:
    return job.seq


class RunningBatch:
    """WAITING and RUNNING jobs (scheduler thread only).

    Args:
        runner: D's ModelRunner; kv: D's CacheManager.
        finished: called when a job's last chunk was streamed (ends the job: ``remove`` comes back).
        memory: D's memory policy (victims, the projection's ratio).
        retract: takes a settled running job out of the batch and off the pool (the scheduler's:
            it fails the job instead when nothing else holds pages that could come back).
        eos_token_ids: the model's stop ids; max_running: running-batch cap.
        overlap_schedule: overlap greedy batches (``decode_svc.overlap``); other batches run
            synchronously.
    """

    def __init__(self, runner: ModelRunner, kv: CacheManager, finished: Callable[[DecodeJob], None], *,
                 memory: DecodeMemory, retract: Callable[[DecodeJob, str], None],
                 eos_token_ids: Iterable[int], max_running: int, overlap_schedule: bool):
        self.runner = runner
        self.kv = kv
        self._finished = finished
        self.memory = memory
        self._retract = retract
        self.eos = set(eos_token_ids)
        self.max_running = max_running
        self.overlap_schedule = overlap_schedule
        self.clock = StepClock()
        self.overlap = OverlapSchedule(runner, kv, self.emit, self.clock)
        self.waiting: list[DecodeJob] = []
        self.running: list[DecodeJob] = []

    @property
    def busy(self) -> bool:
        """Work for the next iteration: a request to decode, or a step in flight."""
        return bool(self.waiting or self.running) or self.overlap.busy

    def jobs(self) -> list[DecodeJob]:
        return self.waiting + self.running

    def start(self, job: DecodeJob, token: int, logprob: common_pb2.TokenLogprob | None) -> None:
        """A committed job: P's first token is streamed now, then the job waits for a slot (unless
        that token finished it)."""
        self.emit(job, token, logprob, first=True)
        if job.state is not JobState.DONE:
            job.state = JobState.WAITING
            bisect.insort(self.waiting, job, key=_by_arrival)

    def remove(self, job: DecodeJob) -> None:
        """The job ended: out of the batch; its KV is freed now, or after the step in flight."""
        (self.running if job.state is JobState.RUNNING else self.waiting).remove(job)
        self.overlap.release(job)

    def join(self) -> None:
        """Waiting jobs take free running slots, earliest arrival first."""
        while self.waiting and len(self.running) < self.max_running:
            job = self.waiting.pop(0)
            job.state = JobState.RUNNING
            bisect.insort(self.running, job, key=_by_arrival)

    def settle(self) -> None:
        """No step half done (before an accounting report)."""
        self.overlap.settle()

    def add_waiting(self, job: DecodeJob) -> None:
        """A resumed job (its KV back in the pool) waits for a running slot again."""
        job.state = JobState.WAITING
        bisect.insort(self.waiting, job, key=_by_arrival)

    def make_room(self) -> None:
        """Give every running job the slot of its next token, retracting victims when short.

        A job that needs a slot is grown to the end of that slot's page (``page_end``): the page is
        taken whole anyway, and the next ``page_size - 1`` steps then need nothing of the pool, so
        growth costs one allocation per page per request, not a slot write and a read of the row's
        last slot (a device sync on CUDA) per request per step."""
        settled = False
        for job in list(self.running):
            if job.state is not JobState.RUNNING or job.kv_len < job.lease.alloc_len:
                continue  # retracted by this loop, or the common step: the slot is already there
            while job.state is JobState.RUNNING and not self.kv.grow(job.lease, self.page_end(job.kv_len + 1)):
                if not settled:  # the step in flight must end before a retraction; its finishes free pages
                    M.DECODE_RESERVE_MISSES.inc()
                    self.overlap.settle()
                    settled = True
                    continue
                victim, reason = self.memory.victim(self.running)
                self._retract(victim, reason)

    def page_end(self, slots: int) -> int:
        """``slots`` rounded up to a whole page, at most the row's length."""
        ps = self.kv.page_size
        return min(-(-slots // ps) * ps, self.kv.r2t.max_context)

    def step(self) -> None:
        """One decode step for every running job (overlapped when the batch allows)."""
        self.clock.tick(len(self.running))
        self.make_room()
        if self.running:
            self.memory.ratio.step()
        if self.overlap_schedule and all(overlappable(j) for j in self.running):
            self.overlap.step(list(self.running))
            return
        self.overlap.settle()  # a batch that cannot overlap: finish the step in flight first
        jobs = list(self.running)
        if not jobs:
            return
        # one host->device copy, slots gathered on the device: row [prefix | delta | reserved decode slots]
        batch = ForwardBatch.decode([j.lease.row for j in jobs], [j.kv_len for j in jobs],
                                    [j.output_ids[-1] for j in jobs], self.kv.r2t.req_to_token)
        with self.clock.device():
            logits = self.runner.forward(batch)
            out = sample(logits, [j.params for j in jobs], [j.generator for j in jobs],
                         [j.prompt_ids for j in jobs], [j.output_ids for j in jobs], [j.grammar for j in jobs])
        M.DECODE_GENERATED_TOKENS.inc(len(jobs))
        for k, job in enumerate(jobs):
            job.kv_len += 1
            lp = None
            if job.params.logprobs or job.params.top_logprobs:
                lp = token_logprob(out.token_ids[k], out.logprobs[k], out.top_logprobs[k])
            self.emit(job, out.token_ids[k], lp)

    def emit(self, job: DecodeJob, tok: int, lp: common_pb2.TokenLogprob | None, first: bool = False) -> None:
        """Append a token, decide whether the request finished, stream the chunk."""
        job.output_ids.append(tok)
        reason, matched = self._finish_reason(job, tok)
        chunk = decode_pb2.DecodeChunk(token_ids=[tok], finish_reason=reason, matched_stop=matched)
        if lp is not None:
            chunk.logprobs.append(lp)
        if first or reason:
            chunk.prompt_tokens = len(job.prompt_ids)
            chunk.cached_tokens = job.cached_tokens
            chunk.decode_prefix_tokens = job.lease.pre_len if job.lease is not None else 0
            chunk.kv_pages_transferred = job.pages_transferred
            chunk.kv_bytes_transferred = job.bytes_transferred
            chunk.completion_tokens = len(job.output_ids)
        job.out.put(chunk)
        if reason:
            job.finish_reason = reason
            self._finished(job)

    def _finish_reason(self, job: DecodeJob, tok: int) -> tuple[str, str]:
        """("stop" | "length" | "", the stop string matched or "") after ``tok`` was appended."""
        p = job.params
        if job.detok is not None:
            job.detok.add(tok)
            if job.detok.stopped:
                return "stop", job.detok.stop_reason or ""
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos) \
                or (job.grammar is not None and job.grammar.terminated):
            return "stop", ""
        if len(job.output_ids) >= p.max_tokens or len(job.prompt_ids) + len(job.output_ids) >= self.runner.max_context:
            return "length", ""
        return "", ""
