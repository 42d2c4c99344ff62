"""D's memory policy: what a request reserves, what admission projects, retraction and resume.

* **Reserve.** ``ondemand`` (default): a request is admitted for its prompt plus a small decode
  reserve (``--num-reserved-decode-tokens``, capped at ``max_tokens - 1``: the last sampled token
  has no K/V) and grows a page at a time before each decode step. ``full``: the old behaviour,
  ``prompt + max_tokens - 1`` slots up front, never grows, never retracts.
* **Projection.** Admission (new requests and resumes) keeps the pages that the live requests are
  projected to still take available (``engine.scheduler.retraction.NewTokenRatio``, which learns
  from every request that ends by itself how much of its ``max_tokens`` it used), so that it
  rarely has to be undone. With nothing else live a request is admitted whenever it fits.
* **Retraction.** When a decode step cannot grow a running request, the newest unpinned running
  request is retracted (``engine.scheduler.retraction.pick_victim``): its committed tokens' full
  pages go to the radix cache, the rest is freed, and it waits here, ahead of every new request.
  Only RUNNING requests are candidates: P answered them, so no peer writes their pages.
* **Resume.** A retracted request is admitted again with ``prompt + output[:-1]`` (the tokens whose
  K/V existed) as its prefix: the radix cache gives back what it kept, and D recomputes the
  uncached tail itself with EXTEND forwards on its own runner, at most ``chunk_tokens`` (the
  engine's ``--chunked-prefill-size``) per scheduler iteration across all resuming requests, so a
  long tail (e.g. without the radix cache: the whole sequence) does not stall the decode batch:
  a decode step runs between chunks. No new prefill leg: P has
  forgotten the room, the router's stream stays as it is, and the tail is short (at most the last
  partial page when the cache kept everything). The job keeps its last sampled token (the next
  input), its sampler generator and its detokenizer, so its stream continues without a gap or a
  repeated token.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from decode_svc.jobs import DecodeJob, JobState
from engine.extend_chunks import extend_batch
from engine.kvcache.cache_manager import CacheManager
from engine.scheduler.retraction import MAX_RETRACTIONS, NewTokenRatio, pick_victim
from telemetry import metrics as M

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

log = logging.getLogger("halfmoon.decode")

RESERVE_MODES = ("ondemand", "full")


class DecodeMemory:
    """Reserve sizes, projected headroom, the retracted queue and resumes (scheduler thread only).

    Args:
        runner: D's ModelRunner (the resume EXTEND forward); kv: D's CacheManager.
        mode: "ondemand" or "full" (see the module docstring).
        reserved_decode_tokens: decode slots admitted with the prompt in ondemand mode (>= 1).
        max_retractions: a request retracted this often is pinned.
        ratio: the projection (default ``NewTokenRatio()``).
        chunk_tokens: most tokens recomputed for resumes per iteration (default: the runner's
            ``chunked_prefill_size``).
    Raises:
        ValueError: an unknown mode, a reserve < 1 or chunk_tokens < 1.
    """

    def __init__(self, runner: ModelRunner, kv: CacheManager, *, mode: str = "ondemand",
                 reserved_decode_tokens: int = 128, max_retractions: int = MAX_RETRACTIONS,
                 ratio: NewTokenRatio | None = None, chunk_tokens: int | None = None):
        if mode not in RESERVE_MODES:
            raise ValueError(f"decode reserve mode {mode!r}: not one of {RESERVE_MODES}")
        if reserved_decode_tokens < 1:
            raise ValueError(f"num_reserved_decode_tokens must be >= 1, got {reserved_decode_tokens}")
        self.runner = runner
        self.kv = kv
        self.mode = mode
        self.reserve = reserved_decode_tokens
        self.max_retractions = max_retractions
        self.ratio = ratio or NewTokenRatio()
        self.max_context = runner.max_context
        self.chunk_tokens = chunk_tokens or runner.config.chunked_prefill_size
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        self.retracted: list[DecodeJob] = []  # arrival order: the oldest resumes first
        # admitted again, tail being recomputed: job -> tokens whose K/V the row holds again
        self.resuming: dict[DecodeJob, int] = {}

    @property
    def ondemand(self) -> bool:
        return self.mode == "ondemand"

    def __len__(self) -> int:
        """Retracted jobs not running yet (waiting to be admitted again, or recomputing)."""
        return len(self.retracted) + len(self.resuming)

    # ------------------------------------------------------------------ sizes
    def reserve_len(self, prompt_len: int, max_tokens: int) -> int:
        """KV slots admission takes for a new request (capped at the row length): prompt +
        ``min(reserve, max_tokens - 1)`` (ondemand) or prompt + max_tokens - 1 (full)."""
        extra = max_tokens - 1 if not self.ondemand else min(self.reserve, max_tokens - 1)
        return min(prompt_len + extra, self.max_context)

    def never_fits(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why such a request can never complete on this pool, or None.

        In both modes that is prompt + max_tokens - 1 slots (capped at the row length) over the whole
        pool: on-demand admission takes less up front, but a request that could outgrow the pool even
        alone is refused at once (RESOURCE_EXHAUSTED) rather than failed mid-stream. A context-sized
        request fits any pool sized for one full context (``halfmoon up``'s default does).
        """
        need = self.kv.pages_for(min(prompt_len + max_tokens - 1, self.max_context))
        total = self.kv.alloc.num_pages
        if need <= total:
            return None
        return (f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs {need} KV pages; "
                f"the decode pool has {total}")

    def future_pages(self, job: DecodeJob) -> int:
        """Pages a live job is projected to still take beyond the slots it holds (0 in full mode)."""
        if job.lease is None:
            return 0
        forked = self.fork_pages(len(job.prompt_ids), job.params.max_tokens, job.n)  # not forked yet
        if not self.ondemand:
            return forked
        done = max(job.kv_len, len(job.prompt_ids))
        want = min(done + self.ratio.projected_tokens(job.params.max_tokens - len(job.output_ids)),
                   self.max_context)
        return forked + max(0, self.kv.pages_for(want) - self.kv.pages_for(job.lease.alloc_len))

    def new_future_pages(self, prompt_len: int, max_tokens: int, held_len: int) -> int:
        """Pages a request about to be admitted with ``held_len`` slots is projected to take later."""
        if not self.ondemand:
            return 0
        want = min(prompt_len + self.ratio.projected_tokens(max_tokens), self.max_context)
        return max(0, self.kv.pages_for(want) - self.kv.pages_for(held_len))

    def fork_pages(self, prompt_len: int, max_tokens: int, n: int) -> int:
        """Pages samples 1..n-1 of a request will take at its fork (``decode_svc.fork``): each its
        reserve beyond the prompt's full pages (which they share) plus its projection."""
        if n <= 1:
            return 0
        held = self.reserve_len(prompt_len, max_tokens)
        own = self.kv.pages_for(held) - prompt_len // self.kv.page_size
        return (n - 1) * (own + self.new_future_pages(prompt_len, max_tokens, held))

    def headroom(self, live: Iterable[DecodeJob]) -> tuple[int, bool]:
        """(pages the live jobs are projected to still take, whether any live job holds a lease)."""
        pages, any_lease = 0, False
        for j in live:
            if j.lease is not None:
                any_lease = True
                pages += self.future_pages(j)
        M.DECODE_PROJECTED_PAGES.set(pages)
        return pages, any_lease

    # ------------------------------------------------------------------ retraction
    def victim(self, running: list[DecodeJob]) -> tuple[DecodeJob | None, str]:
        """The running job to retract (the newest unpinned), and the reason label."""
        return pick_victim(running, arrival=lambda j: j.seq, retractions=lambda j: j.retractions,
                           max_retractions=self.max_retractions)

    def retract(self, job: DecodeJob, reason: str) -> None:
        """Take a settled RUNNING job (already out of the batch, no step in flight writes its slots)
        off the pool: committed full pages to the radix cache, the rest freed; it waits to resume."""
        log.debug("retract room=%d kv_len=%d out=%d (%s)", job.room, job.kv_len, len(job.output_ids), reason)
        job.release_kv(self.kv)
        job.retractions += 1
        job.state = JobState.RETRACTED
        bisect.insort(self.retracted, job, key=lambda j: j.seq)
        self.ratio.on_retract()
        M.DECODE_RETRACTIONS.labels(reason=reason).inc()

    def wait_resume(self, job: DecodeJob) -> None:
        """A job with no lease whose K/V is ``prompt + output[:-1]`` (a forked sample that found no
        pages at the fork) waits with the retracted jobs, resumed like them (not a retraction)."""
        job.state = JobState.RETRACTED
        bisect.insort(self.retracted, job, key=lambda j: j.seq)

    def on_finish(self, job: DecodeJob) -> None:
        """A job ended by itself (stop, EOS, length): the projection learns how much it used."""
        share = self.ratio.on_finish(len(job.output_ids), job.params.max_tokens)
        M.DECODE_FINISHED_TOKEN_SHARE.observe(share)

    def discard(self, job: DecodeJob) -> None:
        """A retracted job ended: forget it; a resuming one gives back its lease, the radix cache
        keeping the full pages of what was recomputed so far."""
        if job in self.retracted:
            self.retracted.remove(job)
        done = self.resuming.pop(job, None)
        if done is not None and job.lease is not None:
            self.kv.release(job.lease, job.kv_tokens()[:done])
            job.lease = None

    def resume(self, live: Iterable[DecodeJob], settle: Callable[[], None],
               start: Callable[[DecodeJob], None]) -> None:
        """Bring retracted jobs back, oldest first: admit each again while the projection allows,
        recompute uncached tails (at most ``chunk_tokens`` this call, so the decode step that
        follows is not held up by a long one), and ``start`` each job whose K/V is whole again
        (back to the waiting list). ``settle`` completes the decode step in flight before D's
        runner runs another forward."""
        live = list(live)
        budget = self.chunk_tokens
        for job in list(self.resuming):
            budget = self._recompute(job, budget, settle, start)
        while self.retracted and budget > 0 and self._admit(self.retracted[0], live):
            job = self.retracted.pop(0)
            self.resuming[job] = job.lease.pre_len
            budget = self._recompute(job, budget, settle, start)

    def _admit(self, job: DecodeJob, live: list[DecodeJob]) -> bool:
        """A lease for ``kv_tokens()`` (matched in the radix cache) plus the reserve, or False."""
        tokens = job.kv_tokens()
        n = len(tokens)
        held = min(n + min(self.reserve, max(1, job.params.max_tokens - len(job.output_ids))),
                   self.max_context)
        others, any_lease = self.headroom(j for j in live if j is not job)
        head = 0
        if any_lease:
            remaining = job.params.max_tokens - len(job.output_ids)
            want = min(n + self.ratio.projected_tokens(remaining), self.max_context)
            head = others + max(0, self.kv.pages_for(want) - self.kv.pages_for(held))
        lease = self.kv.admit(tokens, match_len=n, alloc_len=held, headroom_pages=head)
        if lease is None:
            return False
        job.lease = lease
        M.DECODE_RESUME_RECOMPUTED_TOKENS.inc(n - lease.pre_len)
        return True

    def _recompute(self, job: DecodeJob, budget: int, settle: Callable[[], None],
                   start: Callable[[DecodeJob], None]) -> int:
        """One EXTEND chunk (at most ``budget`` tokens) of ``job``'s tail; starts the job when its
        tail is done. Returns the budget left."""
        tokens = job.kv_tokens()
        n, done = len(tokens), self.resuming[job]
        take = min(n - done, budget)
        if take > 0:
            settle()
            batch = extend_batch(self.kv.r2t.req_to_token, [job.lease.row], [done], [tokens[done:done + take]],
                                 self.runner.device)
            self.runner.forward(batch)
            done += take
            self.resuming[job] = done
        if done == n:
            del self.resuming[job]
            self.kv.commit(job.lease, tokens)
            log.debug("resume room=%d kv_len=%d cached=%d", job.room, n, job.lease.pre_len)
            start(job)
        return budget - take
