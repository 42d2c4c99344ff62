"""The overlap schedule: launch decode step n+1 before reading step n's tokens.

The device computes the next step while the host streams the previous one's tokens (sglang's
overlap scheduler). Only greedy batches without penalties or logprobs overlap: their next input is
the argmax, which stays on the device. A request whose pages a launched step still writes is freed
only after that step completed, so a later request cannot get pages that are being written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from decode_svc.jobs import DecodeJob, JobState
from decode_svc.step_clock import StepClock
from engine.forward_batch import ForwardBatch
from engine.kvcache.cache_manager import CacheManager
from telemetry import metrics as M

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner


@dataclass(eq=False)
class InFlight:
    """A decode step launched on the device whose tokens the host has not read yet.

    ``tokens_dev``: int64 [B] sampled ids on the device (the next step's input ids); ``tokens_host``:
    int64 [B] their host copy (pinned on CUDA), valid once ``copied`` (a CUDA event; None on CPU)
    has completed; ``pos``: id(job) -> index in ``jobs``.
    """

    jobs: list
    tokens_dev: torch.Tensor
    tokens_host: torch.Tensor
    copied: object
    pos: dict


def overlappable(job: DecodeJob) -> bool:
    p = job.params
    # bias and grammar change the argmax, and a grammar needs each token on the host before the next step
    return (p.greedy and not p.has_penalties and not p.logprobs and not p.top_logprobs
            and not p.logit_bias and job.grammar is None)


class OverlapSchedule:
    """At most one step in flight, and the frees that wait for it (scheduler thread only).

    Args:
        runner: D's ModelRunner; kv: D's CacheManager (deferred frees).
        emit: streams one token of a running job (``RunningBatch.emit``); may end that job.
        clock: times the forward and the wait for its tokens (``decode_svc.step_clock``).
    """

    def __init__(self, runner: ModelRunner, kv: CacheManager,
                 emit: Callable[[DecodeJob, int, object], None], clock: StepClock):
        self.runner = runner
        self.clock = clock
        self.kv = kv
        self._emit = emit
        self._inflight: InFlight | None = None
        self._free_after_step: list[DecodeJob] = []  # ended jobs whose slots the step in flight writes

    @property
    def busy(self) -> bool:
        return self._inflight is not None

    @property
    def deferred_pages(self) -> int:
        """Pages still owned by ended jobs waiting for the step in flight."""
        return sum(len(j.lease.own_pages) for j in self._free_after_step)

    def release(self, job: DecodeJob) -> None:
        """Free an ended job's KV now, or after the step in flight when that step writes its slots."""
        if self._inflight is not None and id(job) in self._inflight.pos and job.lease is not None:
            self._free_after_step.append(job)
        else:
            job.release_kv(self.kv)

    def settle(self) -> None:
        """Complete the step in flight, if any (its tokens streamed, deferred frees done)."""
        step, self._inflight = self._inflight, None
        if step is not None:
            self._complete(step)

    def step(self, jobs: list[DecodeJob]) -> None:
        """Launch the next step, then stream the previous one's tokens while the device computes.

        A request whose token is in flight feeds it to the next step straight from the device. One
        whose in-flight token is its last by length is not launched again; one that stops on that
        token (EOS, stop string) was launched once more: that extra token is dropped, and its pages
        are freed only after the step that writes their last slot has completed.
        """
        prev, self._inflight = self._inflight, None
        in_prev = prev.pos if prev is not None else {}  # id(job) -> index of its token in flight
        launch = []
        for j in jobs:
            if id(j) in in_prev:
                n_out = len(j.output_ids) + 1  # the in-flight token included
                if n_out >= j.params.max_tokens or len(j.prompt_ids) + n_out >= self.runner.max_context:
                    continue
            launch.append(j)
        if launch:
            self._launch(launch, prev, in_prev)
        if prev is not None:
            self._complete(prev)

    def _launch(self, launch: list[DecodeJob], prev: InFlight | None, in_prev: dict) -> None:
        dev = self.runner.device
        last = [0 if id(j) in in_prev else j.output_ids[-1] for j in launch]
        batch = ForwardBatch.decode([j.lease.row for j in launch], [j.kv_len for j in launch], last,
                                    self.kv.r2t.req_to_token)
        fed = [(k, in_prev[id(j)]) for k, j in enumerate(launch) if id(j) in in_prev]
        if fed:
            idx = torch.tensor(fed, dtype=torch.int64).to(dev, non_blocking=True)
            batch.input_ids[idx[:, 0]] = prev.tokens_dev[idx[:, 1]]
        on_cuda = dev.type == "cuda"
        with self.clock.device():
            logits = self.runner.forward(batch)
            tokens_dev = logits.argmax(-1)
            host = torch.empty(len(launch), dtype=torch.int64, pin_memory=on_cuda)
            host.copy_(tokens_dev, non_blocking=on_cuda)
        copied = None
        if on_cuda:
            copied = torch.cuda.Event()
            copied.record()
        for j in launch:
            j.kv_len += 1
        self._inflight = InFlight(launch, tokens_dev, host, copied, {id(j): k for k, j in enumerate(launch)})

    def _complete(self, step: InFlight) -> None:
        """Read a launched step's tokens (waits for that step only) and stream them; then free the
        requests that ended while a step wrote into their slots, once no step in flight does."""
        if step.copied is not None:
            with self.clock.device():
                step.copied.synchronize()
        toks = step.tokens_host.tolist()
        live = [(job, tok) for job, tok in zip(step.jobs, toks) if job.state is JobState.RUNNING]
        M.DECODE_GENERATED_TOKENS.inc(len(live))  # the others were aborted or failed in flight
        for job, tok in live:  # emitting one job's token never ends another job
            self._emit(job, tok, None)
        busy = self._inflight.pos if self._inflight is not None else {}
        keep = []
        for job in self._free_after_step:
            if id(job) in busy:
                keep.append(job)
            else:
                job.release_kv(self.kv)
        self._free_after_step = keep
