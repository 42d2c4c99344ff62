"""Pre-allocation on D: a row and KV pages for each new request, before P computes anything.

FIFO: the head waits until a row and its pages are free (evicting unlocked radix pages when that
makes it fit), and nobody overtakes it. A request takes every slot it can ever need up front,
``prompt + max_tokens - 1`` (the last sampled token has no K/V), so D never preempts. The prompt is
matched in D's radix cache (full pages only) and the prefix locked; the row is written ``[prefix
slots (0..pre_len) | delta slots (pre_len..)]`` and only the delta's pages — those P must fill —
go to P in the ``KVDestination``. A page-aligned prompt D fully holds sends no page at all.
"""

from __future__ import annotations

import collections
import functools
import logging
import time

from decode_svc.jobs import DecodeJob, DestState
from decode_svc.kv_wait import KVWaitQueue
from decode_svc.messages import PrefillNet
from decode_svc.quarantine import FencePolicy
from decode_svc.page_checksums import PageChecksums
from engine.kvcache.cache_manager import CacheManager
from protos import prefill_pb2
from telemetry import metrics as M

log = logging.getLogger("halfmoon.decode")


class PreallocQueue:
    """Jobs waiting for a row and pages, in arrival order (scheduler thread only).

    Args:
        kv: D's CacheManager.
        net: sends the destination to P (off the scheduler thread).
        kv_wait: where a pre-allocated job waits for its KV.
        segment_name: D's segment name (P writes into it).
        max_context: tokens per row.
        checksums: ask P for per-page checksums.
        fence: the write window sent to P and the fence deadline of each destination.
        page_sums: verifies a prefix hit's pages before they are reused (None: not checked).
    """

    def __init__(self, kv: CacheManager, net: PrefillNet, kv_wait: KVWaitQueue, *, segment_name: str,
                 max_context: int, checksums: bool, fence: FencePolicy = FencePolicy(),
                 page_sums: PageChecksums | None = None):
        self.kv = kv
        self.page_sums = page_sums
        self.net = net
        self.kv_wait = kv_wait
        self.max_context = max_context
        self.fence = fence
        # what every destination says about D itself
        self._destination = functools.partial(prefill_pb2.KVDestination, decode_segment=segment_name,
                                              decode_worker_id=segment_name, want_checksums=checksums,
                                              write_deadline_ms=fence.window_ms)
        self._queue: collections.deque[DecodeJob] = collections.deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, job: DecodeJob) -> None:
        self._queue.append(job)

    def discard(self, job: DecodeJob) -> None:
        if job in self._queue:
            self._queue.remove(job)

    def reserve_len(self, prompt_len: int, max_tokens: int) -> int:
        """KV slots a request needs on D: prompt + max_tokens - 1 (the last token has no KV),
        capped at the row length."""
        return min(prompt_len + max_tokens - 1, self.max_context)

    def never_fits(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why such a request can never be pre-allocated (more pages than the pool has), or None."""
        need = self.kv.pages_for(self.reserve_len(prompt_len, max_tokens))
        total = self.kv.alloc.num_pages
        if need > total:
            return (f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs {need} KV pages; "
                    f"the decode pool has {total}")
        return None

    def schedule(self) -> None:
        """Pre-allocate from the head while rows and pages allow."""
        while self._queue and self._admit(self._queue[0]):
            self._queue.popleft()

    def _admit(self, job: DecodeJob) -> bool:
        n = len(job.prompt_ids)
        lease = self._lease(job)
        if lease is None:
            return False
        pre = lease.pre_len
        job.lease = lease
        job.dst_pages = lease.own_pages[: self.kv.pages_for(n) - pre // self.kv.page_size]
        job.t_prealloc = time.monotonic()
        job.dest_state = DestState.SENDING
        self.kv_wait.add(job)
        log.debug("prealloc room=%d len=%d pre_len=%d dst=%s", job.room, n, pre, job.dst_pages)
        M.DECODE_PROMPT_TOKENS.inc(n)
        M.DECODE_PREFIX_HIT_TOKENS.inc(pre)
        dest = self._destination(room=job.room, dst_page_ids=job.dst_pages, pre_len=pre, prompt_len=n)
        self.net.set_destination(job.prefill_address, dest, job.request_id, self.fence.stamp(job))
        return True

    def _lease(self, job: DecodeJob):
        n = len(job.prompt_ids)
        while True:
            lease = self.kv.admit(job.prompt_ids, match_len=n,
                                  alloc_len=self.reserve_len(n, job.params.max_tokens))
            # a bad cached page left the tree with what follows it: the next match is shorter
            if lease is None or self.page_sums is None or not self.page_sums.cut_bad_prefix(
                    self.kv, lease, job.prompt_ids):
                return lease
