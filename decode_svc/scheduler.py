"""Decode scheduler: one thread that owns D's KV and every decode request.

A request's path, each stage a queue that owns its jobs::

  PreallocQueue ─row+pages─> KVWaitQueue ─P's notice ok─> RunningBatch (waiting ─slot─> running) ─> done

* ``PreallocQueue`` (FIFO): radix-match the prompt, lock the prefix, allocate the delta and a
  decode reserve, send the delta's page ids to P (``decode_svc.prealloc``).
* ``KVWaitQueue``: on P's notice check the delta (page count, checksums) over ``row[pre_len:]``,
  commit the prompt's full pages to the radix cache, hand P's first token on; KV-wait timeouts,
  SetDestination outcomes, liveness of P (``decode_svc.kv_wait``).
* ``RunningBatch``: one DECODE forward a step for every running request, tokens streamed as they
  come, optionally overlapped (``decode_svc.running``, ``decode_svc.overlap``).
* ``LocalPrefillQueue``: requests with no prefill leg (conditional disaggregation): D computes the
  prompt's uncached tail itself and samples the first token, then they join the running batch
  (``decode_svc.local_prefill``).
* ``Quarantine``: pages P may still write after their request ended (``decode_svc.quarantine``).
* ``DecodeMemory``: reserve, projected admission, retraction when a step cannot grow a request,
  and the resume of retracted requests, ahead of any new one (``decode_svc.memory``).

This class composes them, runs the loop and ends jobs: an ended job leaves its queue, its lease is
released (committed tokens to the radix cache) and its room is forgotten; a job that ends while P
may still write its destination pages leaves them to the quarantine.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING

import grpc

from decode_svc.fork import Forks
from decode_svc.jobs import DecodeJob, DestState, JobState
from decode_svc.kv_wait import KVWaitQueue
from decode_svc.local_prefill import LocalPrefillQueue
from decode_svc.memory import DecodeMemory
from decode_svc.messages import DestResult, Notice, PeerGone, PrefillNet
from decode_svc.page_checksums import PageChecksums
from decode_svc.prealloc import PreallocQueue
from decode_svc.quarantine import FencePolicy, Quarantine
from decode_svc.running import RunningBatch
from engine.cpu_share import NoCpuShare
from engine.kvcache.cache_manager import CacheManager
from engine.kvcache.prefix_cache import NullPrefixCache
from engine.kvcache.radix_cache import RadixCache
from engine.scheduler.retraction import FLOOR_RATIO, INIT_RATIO, NewTokenRatio
from pd_common.inbox import Abort, LoadQuery, Submit, abort_targets
from pd_common.kv_transport import KVReceiver
from pd_common.protocol import ServiceError
from pd_common.scheduler_loop import SchedulerLoop
from protos import common_pb2
from telemetry import metrics as M

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

log = logging.getLogger("halfmoon.decode")


class DecodeScheduler(SchedulerLoop):
    """D's scheduler thread and its API for the gRPC and network threads.

    Args:
        runner: D's ModelRunner (rows = 2 x max_running: pre-allocated and transferring requests
            hold a row without taking a running slot).
        transfer: where P's notices arrive (``transfer_svc.engine.TransferEngine``).
        net: SetDestination / Abort / liveness toward P (``decode_svc.peers.PrefillPeers``).
        segment_name: D's segment name (sent to P in the destination).
        eos_token_ids: stop ids of the model; tokenizer: for stop strings (None: rejected).
        max_running: running-batch cap; disable_radix_cache: no prefix reuse on D.
        checksums: verify per-(page, kv head) checksums of the delta, and of cached pages a prefix hit reuses, on every rank.
        kv_wait_timeout_s: a request waiting for KV this long fails (DEADLINE_EXCEEDED).
        fence: the write window sent to P and when quarantined pages of a silent P may be reused
            (``decode_svc.quarantine.FencePolicy``).
        liveness_interval_s: seconds between liveness checks of the P's that may write D's pages.
        overlap_schedule: launch decode step n+1 before reading step n's tokens, so the GPU computes
            while the host streams the previous tokens. Used for batches of greedy requests without
            penalties or logprobs; other batches run synchronously.
        decode_reserve: "ondemand" (prompt + a reserve, grow, retract) or "full" (every slot up front).
        reserved_decode_tokens: the ondemand reserve; max_retractions: retractions before a request
            is pinned. new_token_ratio: (initial, floor) of the admission projection's ratio.
        resume_chunk_tokens: most tokens a resume recomputes per iteration (default: the runner's
            ``--chunked-prefill-size``).
        cpu_share: cores shared with co-located CPU workers (``engine.cpu_share``): busy while
            requests run, resume or prefill locally.
    """

    def __init__(self, runner: ModelRunner, transfer: KVReceiver, net: PrefillNet, *, segment_name: str,
                 eos_token_ids, tokenizer=None, max_running: int = 32, disable_radix_cache: bool = False,
                 checksums: bool = False, kv_wait_timeout_s: float = 60.0,
                 fence: FencePolicy = FencePolicy(), liveness_interval_s: float = 1.0,
                 overlap_schedule: bool = False, decode_reserve: str = "ondemand",
                 reserved_decode_tokens: int = 128, max_retractions: int = 3,
                 new_token_ratio: tuple[float, float] = (INIT_RATIO, FLOOR_RATIO),
                 resume_chunk_tokens: int | None = None, cpu_share=NoCpuShare()):
        super().__init__("decode-scheduler", runner.device, log)
        self.runner = runner
        self.transfer = transfer
        self.net = net
        self.tokenizer = tokenizer
        alloc = runner.allocator
        cache = NullPrefixCache() if disable_radix_cache else RadixCache(runner.page_size, alloc,
                                                                         enable_events=True)
        self.event_cache = cache
        self.cpu_share = cpu_share
        self.page_sums = PageChecksums(runner) if checksums and cache.enabled else None
        self.kv = CacheManager(alloc, runner.req_to_token_pool, cache, on_evict=M.DECODE_EVICTED_PAGES.inc,
                               on_cached=self.page_sums and self.page_sums.record)
        self.jobs: dict[int, DecodeJob] = {}  # every live job by room, in arrival order
        self.quarantine = Quarantine(alloc, net)
        self.memory = DecodeMemory(runner, self.kv, mode=decode_reserve,
                                   reserved_decode_tokens=reserved_decode_tokens,
                                   max_retractions=max_retractions,
                                   ratio=NewTokenRatio(init=new_token_ratio[0], floor=new_token_ratio[1]),
                                   chunk_tokens=resume_chunk_tokens)
        self.running = RunningBatch(runner, self.kv, self._finish, memory=self.memory, retract=self._retract,
                                    eos_token_ids=eos_token_ids, max_running=max_running,
                                    overlap_schedule=overlap_schedule)
        self.kv_wait = KVWaitQueue(runner, self.kv, net, self.quarantine, self._fail, checksums=checksums,
                                   timeout_s=kv_wait_timeout_s, liveness_interval_s=liveness_interval_s)
        self.prealloc = PreallocQueue(self.kv, net, self.kv_wait, segment_name=segment_name,
                                      memory=self.memory, live=self._live, checksums=checksums,
                                      fence=fence, page_sums=self.page_sums)
        self.local = LocalPrefillQueue(runner, self.kv, self.memory, self._live,
                                       chunk_tokens=self.memory.chunk_tokens, page_sums=self.page_sums)
        self.forks = Forks(runner.kv_pool, self.kv, self.memory, self.running, end=self._end_sample,
                           finish=self._finish_forked, fail=self._fail, tokenizer=tokenizer,
                           group=runner.tp)
        self._arrivals = itertools.count()
        self._notice_thread = threading.Thread(target=self._pump_notices, name="decode-notices", daemon=True)

    # ------------------------------------------------------------------ API (any thread)
    def start(self) -> None:
        super().start()
        self._notice_thread.start()

    def stop(self, message: str = "decode worker is shutting down") -> None:
        super().stop(message)

    def submit(self, job: DecodeJob) -> None:
        """Queue a new request; its outcome comes on ``job.out`` (a room in use: ALREADY_EXISTS)."""
        if not self.known.claim(job):
            job.out.put(ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"room {job.room} is in use"))
        else:
            self.inbox.post(Submit(job))

    def abort(self, room: int, request_id: str, reason: str, sample: int | None = None) -> bool:
        """Queue an abort (never waits for the scheduler); returns whether the request is known.
        ``sample``: end only that sample of an ``n > 1`` request (``decode_svc.fork``)."""
        found = self.known.knows(room, request_id)
        self.inbox.post(Abort(room, request_id, reason, sample=sample))
        return found

    def post(self, msg: DestResult | PeerGone | Notice) -> None:
        """A message from a network thread."""
        self.inbox.post(msg)

    def reserve_len(self, prompt_len: int, max_tokens: int) -> int:
        """KV slots D admits a request with (``DecodeMemory.reserve_len``)."""
        return self.memory.reserve_len(prompt_len, max_tokens)

    def never_fits(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why a request of this size can never fit D's pool, or None."""
        return self.memory.never_fits(prompt_len, max_tokens)

    # ------------------------------------------------------------------ loop
    def _pump_notices(self) -> None:
        while not self._stop:
            try:
                for n in self.transfer.wait_notify(0.2):
                    self.inbox.post(Notice(n.sender, n.payload))
            except Exception:
                log.exception("notice pump")
                time.sleep(0.1)

    def _computing(self) -> bool:
        return bool(self.running.busy or self.memory.resuming or self.local.computing)

    def idle_wait(self) -> float:
        if self._computing():
            return 0.0
        return 0.01 if len(self.prealloc) or len(self.memory) or len(self.local) else 0.1

    def handle(self, msg: object) -> None:
        match msg:
            case Submit(job=job):
                self._accept(job)
            case Abort():
                self._abort(msg)
            case LoadQuery():
                self.running.settle()  # report settled accounting: no step half done
                self.answer_load(msg, self._load_report(), self.runner)
            case Notice():
                committed = self.kv_wait.on_notice(msg)
                if committed is not None:
                    (self.forks.fork if committed[0].n > 1 else self.running.start)(*committed)
                    # only now: a commit or first token that raised leaves the job to the KV-wait timeout
                    self.kv_wait.discard(committed[0])
            case DestResult():
                self.kv_wait.on_dest_result(msg)
            case PeerGone():
                self.kv_wait.on_peer_gone(msg)

    def iterate(self) -> None:
        self.cpu_share.mark(self._computing())
        now = time.monotonic()
        self.kv_wait.expire(now)
        self.quarantine.expire(now)
        self.kv_wait.poll_liveness(now)
        self.memory.resume(self._live(), self.running.settle, self.running.add_waiting)
        if not len(self.memory):  # retracted requests come back before any new one is admitted
            self.prealloc.schedule()
        self.local.step(not len(self.memory), self.running.settle, self.running.start)
        self.running.join()
        self.running.step()
        self.cpu_share.mark(self._computing())  # idle at once: P takes the cores back
        self._gauges()

    def on_iteration_error(self) -> None:
        for job in sorted(self.running.jobs() + self.local.computing, key=lambda j: j.seq):
            self._fail(job, ServiceError(grpc.StatusCode.INTERNAL, "decode scheduler error"))

    def live_jobs(self) -> list:
        return list(self.jobs.values())

    def _live(self) -> list[DecodeJob]:
        """Every job that may hold KV: the requests, and the samples of forked ones."""
        return list(self.jobs.values()) + list(self.forks.samples())

    def answer_shutdown(self, job: DecodeJob, err: ServiceError) -> None:
        if not job.finish_reason:
            job.out.put(err)

    # ------------------------------------------------------------------ jobs
    def _accept(self, job: DecodeJob) -> None:
        if job.room in self.jobs or job.room in self.quarantine:
            job.out.put(ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"room {job.room} is in use"))
            self.known.discard(job)  # only what this job claimed
            return
        job.seq = next(self._arrivals)
        self.jobs[job.room] = job
        (self.local if job.local_prefill else self.prealloc).add(job)

    def _abort(self, msg: Abort) -> None:
        for job in abort_targets(self.jobs, msg):
            if msg.sample is not None and (job.n > 1 or msg.sample):  # sample 0 of n=1: the request
                self.forks.abort_sample(job, msg.sample, msg.reason or "aborted")
                continue
            job.aborted = msg.reason or "aborted"
            self._fail(job, ServiceError(grpc.StatusCode.CANCELLED, f"aborted: {job.aborted}"))

    def _finish(self, job: DecodeJob) -> None:
        """Normal end: KV delivered and committed; release everything, end the stream."""
        self.memory.on_finish(job)
        self._end(job, quarantine=False)
        job.out.put(None)

    def _finish_forked(self, job: DecodeJob) -> None:
        """A forked request whose samples all ended: its stream ends."""
        self._end(job, quarantine=False)
        job.out.put(None)

    def _end_sample(self, job: DecodeJob) -> None:
        self._end(job, quarantine=False)

    def _fail(self, job: DecodeJob, err: ServiceError) -> None:
        if job.state is JobState.DONE:
            return
        may_write = job.state is JobState.TRANSFER and job.dest_state.may_write
        if may_write and job.dest_state is DestState.ACCEPTED:
            self.net.abort(job.prefill_address, job.room, job.request_id, str(err))
        self._end(job, quarantine=may_write)
        job.out.put(err)

    def _retract(self, job: DecodeJob, reason: str) -> None:
        """A running job the pool cannot grow: retract it, unless nothing else holds pages that
        could ever come back (then it can never grow: RESOURCE_EXHAUSTED)."""
        others = any(j.lease is not None for j in self._live() if j is not job)
        if not others and not self.quarantine.num_pages:
            self._fail(job, ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                         f"decode KV pool exhausted at {job.kv_len + 1} tokens "
                                         f"({self.kv.alloc.num_pages} pages)"))
            return
        self.running.running.remove(job)
        self.memory.retract(job, reason)

    def _end(self, job: DecodeJob, *, quarantine: bool) -> None:
        """The job is over: out of its queue, its KV released (the destination pages to the
        quarantine when P may still write them), its room forgotten."""
        if job.state in (JobState.WAITING, JobState.RUNNING):
            self.running.remove(job)  # frees now, or after the decode step in flight
        elif job.state is JobState.RETRACTED:
            self.memory.discard(job)  # a lease only while its tail is being recomputed
        elif job.state is JobState.FORKED:
            self.forks.end_samples(job)  # holds no KV itself
        else:
            queue = {JobState.PREALLOC: self.prealloc, JobState.LOCAL_PREFILL: self.local}.get(job.state, self.kv_wait)
            queue.discard(job)
            withhold = self.quarantine.hold(job) if quarantine else ()
            job.release_kv(self.kv, keep_tokens=not quarantine, withhold=withhold)
        job.state = JobState.DONE
        self.known.discard(job)
        if self.jobs.get(job.room) is job:
            del self.jobs[job.room]

    # ------------------------------------------------------------------ accounting
    def _owned(self) -> int:
        """Pages held outside the radix cache: leases, quarantine, frees waiting for a step."""
        return (sum(len(j.lease.own_pages) for j in self._live() if j.lease is not None)
                + self.quarantine.num_pages + self.running.overlap.deferred_pages)

    def _load_report(self) -> common_pb2.LoadReport:
        st = self.kv.cache.stats()
        alloc = self.kv.alloc
        total = alloc.num_pages
        acc = common_pb2.KVAccounting(
            total_pages=total, free_pages=alloc.num_free, evictable_pages=st.evictable_pages,
            locked_pages=st.protected_pages, owned_pages=self._owned(), min_lock_ref=st.min_lock_ref,
            held_rooms=len(self.jobs) + len(self.quarantine), held_req_slots=self.kv.r2t.num_used)
        return common_pb2.LoadReport(
            waiting_requests=len(self.prealloc) + len(self.memory) + len(self.local),
            running_requests=len(self.running.waiting) + len(self.running.running),
            transferring_requests=len(self.kv_wait),
            kv_usage=1.0 - alloc.num_free / total, accounting=acc)

    def _gauges(self) -> None:
        M.DECODE_QUEUE.labels(queue="prealloc").set(len(self.prealloc))
        M.DECODE_QUEUE.labels(queue="transfer").set(len(self.kv_wait))
        M.DECODE_QUEUE.labels(queue="waiting").set(len(self.running.waiting))
        M.DECODE_QUEUE.labels(queue="retracted").set(len(self.memory))
        M.DECODE_QUEUE.labels(queue="local_prefill").set(len(self.local))
        M.DECODE_NEW_TOKEN_RATIO.set(self.memory.ratio.value)
        M.DECODE_RUNNING.set(len(self.running.running))
        alloc, cache = self.kv.alloc, self.kv.cache
        ev, lk = cache.evictable_size(), cache.protected_size()
        # evictable radix pages are reclaimable, so they don't count as used (SGLang's convention)
        M.DECODE_KV_USAGE.set(1.0 - (alloc.num_free + ev) / alloc.num_pages)
        M.DECODE_KV_PAGES.labels(state="free").set(alloc.num_free)
        M.DECODE_KV_PAGES.labels(state="evictable").set(ev)
        M.DECODE_KV_PAGES.labels(state="locked").set(lk)
        M.DECODE_KV_PAGES.labels(state="owned").set(self._owned())
