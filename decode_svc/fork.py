"""n samples of one request on D (``DecodeRequest.n``): one prefill, one transfer, then a fork.

P samples n first tokens from the prompt's one logits row (``KVNotice.samples``). When D commits
the notice, the request forks into n *samples*, each a ``DecodeJob`` of its own (``index`` i) that
runs like any request: it decodes in the running batch, can be retracted (it frees only its own
pages and resumes with ``prompt + its output``, like any retracted request) and finishes by itself
(freeing only its own pages). The request job itself (what the room, the stream and every abort
name) becomes ``FORKED``: it holds no KV, and ends when its last sample ends.

* **Shared pages: lock refs through the radix cache.** The commit just put the prompt's full pages
  into D's radix cache, so sample 0 keeps the request's lease and each sample i >= 1 is admitted
  with the prompt as its prefix (``CacheManager.admit(match_len=len(prompt))``): the tree hands
  back those very pages and the sample's lease locks their node, one lock ref per sample, dropped by
  its own release, retraction or abort. Chosen over copying the row's page ids with a shared-owner
  count: the tree already counts sharers, never evicts a locked page and is what the accounting
  (free + evictable + locked + owned) and the victim policy already read; an owner count would be a
  second reference count that release, retraction and the accounting would all have to learn.
* **The partial last page is copied** (``KVPool.copy_pages``) into each sample's own page, since
  each sample writes its own next tokens there: copy-on-write of the one page the samples would
  otherwise share while writing. A sample whose match is shorter (no radix cache, or a prefix
  invalidated under the request) copies every prompt page it did not match: correct, not shared.
* **Memory.** Admission counts the n samples (``DecodeMemory.fork_pages``, and the projection of
  each). A sample that finds no row or pages at the fork still streams its first token, then waits
  in the retracted queue and is resumed like a retracted request (D recomputes its partial page).
* **Endings.** A sample's finish frees its pages; ``AbortRequest.sample`` ends one sample (finish
  ``abort``, the others run on); an abort of the request, or any sample's failure, ends all.

Not forked: ``local_prefill`` requests (D samples one first token: ``n > 1`` is INVALID_ARGUMENT
naming ``n``); migration of an ``n > 1`` stream is refused by the router.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import grpc
import torch

from decode_svc.jobs import DecodeJob, DestState, JobState
from decode_svc.memory import DecodeMemory
from decode_svc.running import RunningBatch
from engine.kvcache.cache_manager import CacheManager
from engine.kvcache.kv_pool import KVPool
from engine.sampler import make_generator
from engine.sampling_params import for_sample
from pd_common.head_blocks import copy_pages_on_ranks
from pd_common.protocol import ServiceError
from protos import common_pb2, decode_pb2


class SampleOut:
    """A sample's ``out``: its chunks go on the request's stream queue tagged with its index; its
    end (None, or a ServiceError) goes to the fork, which ends the request when it is the last."""

    def __init__(self, fork: Fork, index: int):
        self.fork, self.index = fork, index

    def put(self, item: decode_pb2.DecodeChunk | ServiceError | None) -> None:
        if isinstance(item, decode_pb2.DecodeChunk):
            item.index = self.index
            self.fork.request.out.put(item)
        else:
            self.fork.ended(self.index, item)


@dataclasses.dataclass(eq=False)
class Fork:
    """One forked request: ``request`` (FORKED, the stream's queue) and its ``samples`` by index."""

    request: DecodeJob
    samples: list[DecodeJob]
    on_done: Callable[[DecodeJob], None]
    on_failed: Callable[[DecodeJob, ServiceError], None]

    def live(self) -> list[DecodeJob]:
        return [s for s in self.samples if s.state is not JobState.DONE]

    def ended(self, index: int, end: ServiceError | None) -> None:
        if end is not None:
            self.on_failed(self.request, end)   # one sample's failure fails the request
        elif not self.live() and self.request.state is not JobState.DONE:
            self.request.finish_reason = self.samples[index].finish_reason
            self.on_done(self.request)


class Forks:
    """The forked requests of one D (scheduler thread only).

    Args:
        pool: D's KV pool (the copied pages); kv: D's CacheManager; memory: D's memory policy (reserve, the retracted queue);
        running: the running batch (a forked sample's first token and slot).
        end: ends one job's queue membership and KV (the scheduler's ``_end``, no quarantine).
        finish: ends a request whose samples all ended by themselves (its stream ends).
        fail: fails a request (its stream ends with the error).
        tokenizer: for each sample's stop-string detokenizer (None: no stop strings).
        group: D's ``TPGroup`` under tensor parallelism (the copies go to every rank), else None.
    """

    def __init__(self, pool: KVPool, kv: CacheManager, memory: DecodeMemory, running: RunningBatch, *,
                 end: Callable[[DecodeJob], None], finish: Callable[[DecodeJob], None],
                 fail: Callable[[DecodeJob, ServiceError], None], tokenizer=None, group=None):
        self.pool, self.kv, self.memory, self.running = pool, kv, memory, running
        self.group = group  # D's TPGroup (None: one rank): followers copy their own heads of a page
        self._end, self._finish, self._fail = end, finish, fail
        self.tokenizer = tokenizer
        self._forks: dict[DecodeJob, Fork] = {}

    def samples(self) -> Iterator[DecodeJob]:
        """Every live sample of every forked request."""
        for f in self._forks.values():
            yield from f.live()

    def fork(self, request: DecodeJob, token: int, logprob: common_pb2.TokenLogprob | None) -> None:
        """Fork a committed request (``request.first_samples``: P's samples 1..n-1) into its samples
        and start each with its first token. A first token a sample's grammar refuses fails the
        request (INTERNAL) before any sample is admitted."""
        firsts = [(token, logprob, b"")] + [
            (int(s.token_id), s.logprob if logprob is not None else None, s.sampler_state)
            for s in request.first_samples]
        request.first_samples = []
        for i in range(1, request.n):   # sample 0's was replayed at the commit
            g = request.sample_grammars[i - 1] if request.grammar is not None else None
            if g is not None and not g.accept(firsts[i][0]):
                self._fail(request, ServiceError(grpc.StatusCode.INTERNAL, f"prefill's first token "
                                                 f"{firsts[i][0]} of sample {i} is not allowed by the grammar"))
                return
        fork = Fork(request, [], self._done, self._fail)
        for i in range(request.n):
            fork.samples.append(self._sample(request, fork, i, firsts[i][2]))
        self._forks[request] = fork
        request.state = JobState.FORKED
        for i, s in enumerate(fork.samples):
            if i in request.sample_aborts:
                self._abort(fork, s, "aborted before the fork")
            elif s.lease is None:          # no row or pages now: stream the token, resume later
                s.state = JobState.RETRACTED
                self.running.emit(s, *firsts[i][:2], first=True)
                if s.state is not JobState.DONE:
                    self.memory.wait_resume(s)
            else:
                self.running.start(s, *firsts[i][:2])

    def _sample(self, request: DecodeJob, fork: Fork, i: int, sampler_state: bytes | None) -> DecodeJob:
        params = for_sample(request.params, i)
        s = DecodeJob(request_id=request.request_id, room=request.room, prompt_ids=request.prompt_ids,
                      params=params, prefill_address=request.prefill_address, index=i,
                      out=SampleOut(fork, i), seq=request.seq, kv_len=len(request.prompt_ids),
                      dest_state=DestState.ANSWERED, cached_tokens=request.cached_tokens)
        if i == 0:   # sample 0 is the request's own KV, generator, matcher and detokenizer
            s.lease, request.lease = request.lease, None
            s.generator, s.grammar, s.detok = request.generator, request.grammar, request.detok
            s.pages_transferred, s.bytes_transferred = request.pages_transferred, request.bytes_transferred
            return s
        s.grammar = request.sample_grammars[i - 1] if request.grammar is not None else None
        if request.detok is not None:
            from engine.detokenizer import IncrementalDetokenizer

            s.detok = IncrementalDetokenizer(self.tokenizer, s.prompt_ids, params.stop,
                                             params.skip_special_tokens)
        if not params.greedy:
            s.generator = make_generator(params.seed, request.generator.device)
            if sampler_state:   # P's generator after this sample's first token
                s.generator.set_state(torch.frombuffer(bytearray(sampler_state), dtype=torch.uint8))
        s.lease = self._share(fork.samples[0], len(s.prompt_ids), params.max_tokens)
        return s

    def _share(self, first: DecodeJob, n: int, max_tokens: int):
        """A lease for a sample: the prompt's cached pages shared (locked), the rest copied from
        sample 0's row; None when no row or pages are free now."""
        lease = self.kv.admit(first.prompt_ids, match_len=n, alloc_len=self.memory.reserve_len(n, max_tokens))
        if lease is None:
            return None
        ps, r2t = self.kv.page_size, self.kv.r2t.req_to_token
        src = r2t[first.lease.row, lease.pre_len:n:ps] // ps
        dst = r2t[lease.row, lease.pre_len:n:ps] // ps
        if src.numel():
            copy_pages_on_ranks(self.pool, self.group, src, dst)  # every rank holds some of its heads
        return lease

    def _done(self, request: DecodeJob) -> None:
        del self._forks[request]
        self._finish(request)

    def end_samples(self, request: DecodeJob) -> None:
        """The request ends (abort, failure): every live sample ends with it, its KV released."""
        fork = self._forks.pop(request, None)
        for s in fork.live() if fork is not None else ():
            self._end(s)

    def abort_sample(self, request: DecodeJob, index: int, reason: str) -> None:
        """End sample ``index`` of ``request`` alone (finish ``abort``); before the fork, it is
        ended at the fork. Out-of-range indexes and ended samples are ignored (nothing to end)."""
        fork = self._forks.get(request)
        if index >= request.n:
            return
        if fork is None:
            request.sample_aborts.add(index)
        elif fork.samples[index].state is not JobState.DONE:
            self._abort(fork, fork.samples[index], reason)

    def _abort(self, fork: Fork, s: DecodeJob, reason: str) -> None:
        s.aborted, s.finish_reason = reason, "abort"
        self._end(s)
        s.out.put(decode_pb2.DecodeChunk(finish_reason="abort", prompt_tokens=len(s.prompt_ids),
                                         cached_tokens=s.cached_tokens, completion_tokens=len(s.output_ids)))
        s.out.put(None)


__all__ = ["Fork", "Forks", "SampleOut"]
