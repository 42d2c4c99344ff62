"""Admission: the waiting queue, first come first served, into KV leases on P's pool.

A job is admitted when a request row and the pages for its whole prompt are available. P's prefix
cache may supply the prompt's leading full pages, but never the last token: its logits give the
first output token, so at least that token is computed. The head of the queue waits until others
release what it needs; only when nothing else holds a row (nothing will be released) does it fail.
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

    def enqueue(self, job: PrefillJob) -> None:
        self.waiting.append(job)

    def discard(self, job: PrefillJob) -> None:
        if job in self.waiting:
            self.waiting.remove(job)

    def admit(self) -> tuple[list[PrefillJob], PrefillJob | None]:
        """Lease KV for jobs from the head of the queue while it fits.

        Returns:
            (admitted, refused): the admitted jobs in order (now ``PREFILLING``, ``computed`` =
            ``pre_len``), and the head job when it does not fit even though no other job holds a
            row, which the caller fails (RESOURCE_EXHAUSTED); it is still queued.
        """
        admitted: list[PrefillJob] = []
        while self.waiting:
            job = self.waiting[0]
            n = len(job.prompt_ids)
            lease = self.kv.admit(job.prompt_ids, match_len=n - 1, alloc_len=n)
            if lease is None:
                # no row or no pages; with no row held by anyone, nothing will ever be freed
                return admitted, (job if self.kv.r2t.num_used == 0 else None)
            self.waiting.popleft()
            job.lease, job.pre_len, job.computed = lease, lease.pre_len, lease.pre_len
            job.state = JobState.PREFILLING
            job.t_admit = time.monotonic()
            M.PREFILL_CACHED_TOKENS.inc(lease.pre_len)
            admitted.append(job)
        return admitted, None

    def release(self, job: PrefillJob) -> None:
        """Give back the job's lease: its computed full pages stay in P's prefix cache, the other
        pages and the row are freed. Only once no transfer reads the pages (``job.busy`` False)."""
        if job.lease is not None:
            self.kv.release(job.lease, job.prompt_ids[:job.computed])
            job.lease = None

    def owned_pages(self, jobs) -> int:
        """Pages the leases of ``jobs`` hold outside the prefix cache."""
        return sum(len(j.lease.own_pages) for j in jobs if j.lease is not None)
