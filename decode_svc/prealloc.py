"""Pre-allocation on D: a row and KV pages for each new request, before P computes anything.

FIFO: the head waits until a row and its pages are free (evicting unlocked radix pages when that
makes it fit), and nobody overtakes it. A request takes its prompt plus a small decode reserve and
grows later; admission keeps the pages the live requests are projected to still need available
(``decode_svc.memory``; ``--decode-reserve full``: every slot up front). The prompt is
matched in D's radix cache (full pages only) and the prefix locked; the row is written ``[prefix
slots (0..pre_len) | delta slots (pre_len..)]`` and only the delta's pages — those P must fill —
go to P in the ``KVDestination``. A page-aligned prompt D fully holds sends no page at all.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable, Iterable

from decode_svc.jobs import DecodeJob, DestState
from decode_svc.kv_wait import KVWaitQueue
from decode_svc.memory import DecodeMemory
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
        memory: reserve sizes and the projected headroom; live: every live job (for the projection).
        checksums: ask P for per-(page, kv head) checksums.
        fence: the write window sent to P and the fence deadline of each destination.
        page_sums: verifies a prefix hit's pages before they are reused (None: not checked).
    """

    def __init__(self, kv: CacheManager, net: PrefillNet, kv_wait: KVWaitQueue, *, segment_name: str,
                 memory: DecodeMemory, live: Callable[[], Iterable[DecodeJob]], checksums: bool,
                 fence: FencePolicy = FencePolicy(), page_sums: PageChecksums | None = None):
        self.kv = kv
        self.memory = memory
        self._live = live
        self.page_sums = page_sums
        self.net = net
        self.kv_wait = kv_wait
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
        self.net.set_destination(job.prefill_address, dest, job.request_id, self.fence.stamp(job),
                                 job.prefill_worker_id)
        return True

    def _lease(self, job: DecodeJob):
        n = len(job.prompt_ids)
        while True:
            mt = job.params.max_tokens
            held = self.memory.reserve_len(n, mt)
            others, any_lease = self.memory.headroom(self._live())
            head = others + self.memory.new_future_pages(n, mt, held) if any_lease else 0
            if any_lease:  # alone, a request is admitted whenever it fits: samples short at the fork wait
                head += self.memory.fork_pages(n, mt, job.n)
            lease = self.kv.admit(job.prompt_ids, match_len=n, alloc_len=held, headroom_pages=head)
            # a bad cached page left the tree with what follows it: the next match is shorter
            if lease is None or self.page_sums is None or not self.page_sums.cut_bad_prefix(
                    self.kv, lease, job.prompt_ids):
                return lease
