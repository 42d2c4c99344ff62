"""Admission: the waiting queue, first come first served, into KV leases on P's pool.

A job is admitted when a request row and the pages for its whole prompt are available. P's prefix
cache may supply the prompt's leading full pages, but never the last token: its logits give the
first output token, so at least that token is computed. The head of the queue waits until others
release what it needs; only when nothing else holds a row (nothing will be released) does it fail.

In-flight prefixes: a job whose prompt shares full pages with a job admitted ahead of it and not yet
released, beyond what the cache already holds, waits for that job's release instead of computing
the same pages again in the same batch (the release hands them to the prefix cache). It waits only
when the shared pages are at least half of what it would compute (a short common system prompt is
not worth a prefill's delay); jobs behind it that share nothing are admitted meanwhile. Without
this, a burst of requests with one 600-token system prompt computed it once per request: 8 x 640
tokens on P instead of 640 + 7 x 40. SGLang's scheduler deprioritizes such requests the same way
(its in-batch prefix check).
"""

from __future__ import annotations

import collections
import time

from engine.kvcache.cache_manager import CacheManager
from prefill_svc.jobs import JobState, PrefillJob
from telemetry import metrics as M


class Admission:
    """Owns the waiting queue (``QUEUED`` jobs, arrival order) and every job's KV lease."""

    def __init__(self, kv: CacheManager):
        self.kv = kv
        self.waiting: collections.deque[PrefillJob] = collections.deque()
        self.leased: list[PrefillJob] = []  # admitted, not yet released (admission order)
        # a waiting job's "waits for an in-flight prefix" answer holds until a lease is taken or
        # released (the only events that change it): the scheduler loop asks every iteration
        self._generation = 0
        self._waits: dict[int, tuple[int, bool]] = {}  # id(job) -> (generation, answer)

    def enqueue(self, job: PrefillJob) -> None:
        self.waiting.append(job)

    def discard(self, job: PrefillJob) -> None:
        if job in self.waiting:
            self.waiting.remove(job)
        self._waits.pop(id(job), None)

    def ready(self) -> bool:
        """True when a queued job is not waiting for an in-flight prefix (admit() may take it)."""
        return any(not self.waits_for_inflight_prefix(job) for job in self.waiting)

    def admit(self) -> tuple[list[PrefillJob], PrefillJob | None]:
        """Lease KV for queued jobs in arrival order while it fits, passing over the ones that wait
        for an in-flight prefix (module docstring).

        Returns:
            (admitted, refused): the admitted jobs in order (now ``PREFILLING``, ``computed`` =
            ``pre_len``), and the first job that does not fit even though no other job holds a
            row, which the caller fails (RESOURCE_EXHAUSTED); it is still queued.
        """
        admitted: list[PrefillJob] = []
        for job in list(self.waiting):
            if self.waits_for_inflight_prefix(job):
                continue
            n = len(job.prompt_ids)
            lease = self.kv.admit(job.prompt_ids, match_len=n - 1, alloc_len=n)
            if lease is None:
                # no row or no pages; with no row held by anyone, nothing will ever be freed
                return admitted, (job if self.kv.r2t.num_used == 0 else None)
            self.waiting.remove(job)
            self._waits.pop(id(job), None)
            self._generation += 1
            job.lease, job.pre_len, job.computed = lease, lease.pre_len, lease.pre_len
            job.state = JobState.PREFILLING
            job.t_admit = time.monotonic()
            M.PREFILL_CACHED_TOKENS.inc(lease.pre_len)
            self.leased.append(job)
            admitted.append(job)
        return admitted, None

    def waits_for_inflight_prefix(self, job: PrefillJob) -> bool:
        """True when a leased job computes full pages of ``job``'s prompt that the cache does not
        hold yet, and they are at least half of the tokens ``job`` would compute now."""
        if not self.leased or not self.kv.cache.enabled:
            return False
        memo = self._waits.get(id(job))
        if memo is not None and memo[0] == self._generation:
            return memo[1]
        ps, tokens = self.kv.page_size, job.prompt_ids
        n = len(tokens)
        cached = self.kv.cache.match_prefix(tokens[:n - 1])[0].numel()
        shared = max(_common_prefix(tokens, other.prompt_ids, n - 1) for other in self.leased) // ps * ps
        gain = shared - cached
        waits = gain >= ps and 2 * gain >= n - cached
        self._waits[id(job)] = (self._generation, waits)
        return waits

    def release(self, job: PrefillJob) -> None:
        """Give back the job's lease: its computed full pages stay in P's prefix cache, the other
        pages and the row are freed. Only once no transfer reads the pages (``job.busy`` False)."""
        if job in self.leased:
            self.leased.remove(job)
            self._generation += 1
        if job.lease is not None:
            self.kv.release(job.lease, job.prompt_ids[:job.computed])
            job.lease = None

    def owned_pages(self, jobs) -> int:
        """Pages the leases of ``jobs`` hold outside the prefix cache."""
        return sum(len(j.lease.own_pages) for j in jobs if j.lease is not None)


def _common_prefix(a, b, limit: int) -> int:
    """Length of the common prefix of token lists ``a`` and ``b``, at most ``limit`` (a binary search
    over slice compares, which run in C)."""
    lo, hi = 0, min(len(a), len(b), limit)
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # a[:lo] == b[:lo]; the answer is in [lo, hi]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
