"""Prefill scheduler: one thread drives the ModelRunner; gRPC threads talk to it through the inbox.

Each iteration, after the inbox: expire late destinations and jobs (``DeltaSender.expire``), collect
finished transfers (``poll``), admit waiting jobs (``Admission``), hand them D's destinations
(``claim``), run one chunked extend batch (``ChunkedPrefill``), send the pages it computed
(``send_ready``). Job states: ``prefill_svc.jobs``.

A job ends once no write of it is pending (source pages stay allocated while the transport reads
them), on every path (success, failure, abort, timeout): its computed full pages go to P's prefix
cache, the rest of its pages and its row are freed, an accepted destination that got no ok notice
gets an ok=false one, and the caller is answered.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING

import grpc

from engine.cpu_share import NoCpuShare
from engine.kvcache.cache_manager import CacheManager
from engine.kvcache.paging import pages_for
from engine.kvcache.prefix_cache import NullPrefixCache
from engine.kvcache.radix_cache import RadixCache
from pd_common.inbox import Abort, LoadQuery, Submit, Wake, abort_targets
from pd_common.kv_transport import KVSender
from pd_common.protocol import ServiceError, published_layout, token_logprob
from pd_common.scheduler_loop import SchedulerLoop
from prefill_svc.admission import Admission
from prefill_svc.chunked_prefill import ChunkedPrefill
from prefill_svc.destinations import DestinationBook
from prefill_svc.jobs import Destination, JobState, PrefillJob
from prefill_svc.kv_runs import PoolGeometry
from prefill_svc.kv_sender import DeltaSender, TransferLog
from protos import common_pb2, prefill_pb2
from telemetry import metrics as M

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner
    from transfer_svc.engine import Segment

log = logging.getLogger("halfmoon.prefill")


class PrefillScheduler(SchedulerLoop):
    """Owns the ModelRunner, P's prefix cache and every job; see the module docstring.

    Args:
        runner: P's model runner.
        transfer: the KV transport, with the runner's pool registered.
        destination_timeout_s: a job without a destination this long after arrival fails
            (DEADLINE_EXCEEDED); an unclaimed destination is dropped after the same time.
        transfer_log: path of a JSONL file, one line per submitted batch and per notice, or None.
        checksums: put per-(page, kv head) checksums in every ok notice (D may also ask per destination).
        disable_radix_cache: no prefix cache on P (every prompt is computed whole).
        lease_valid_for, lease_fence_margin_s: P's own view of its registry lease; no KV write
            starts while it is below the margin (``DeltaSender``).
        rank_writer: ``prefill_svc.rank_writer.RankWriter`` for tensor-parallel pairs (None: single
            rank on both sides only).
        cpu_share: cores shared with co-located CPU workers (``engine.cpu_share``): busy while a
            job is prefilling.
    """

    def __init__(self, runner: ModelRunner, transfer: KVSender, *, destination_timeout_s: float = 60.0,
                 transfer_log: str | None = None, checksums: bool = False,
                 disable_radix_cache: bool = False, lease_valid_for=None,
                 lease_fence_margin_s: float = 0.0, rank_writer=None, cpu_share=NoCpuShare()):
        super().__init__("prefill-scheduler", runner.device, log)
        self.runner = runner
        self.transfer = transfer
        self.ps = runner.page_size
        self.alloc = runner.allocator
        self.r2t = runner.req_to_token_pool
        self.cache = NullPrefixCache() if disable_radix_cache else RadixCache(self.ps, self.alloc,
                                                                              enable_events=True)
        self.event_cache = self.cache
        self.cpu_share = cpu_share
        self.book = DestinationBook(destination_timeout_s)
        # the same description of this pool that the worker publishes
        self.geometry = PoolGeometry.from_layout(published_layout(runner, runner.config.model))
        self.jobs: dict[int, PrefillJob] = {}  # room -> job, arrival order
        self.admission = Admission(CacheManager(self.alloc, self.r2t, self.cache))
        self.prefill = ChunkedPrefill(runner, runner.config.chunked_prefill_size)
        self.sender = DeltaSender(transfer, runner, self.geometry, self.book, self,
                                  destination_timeout_s=destination_timeout_s, checksums=checksums,
                                  transfer_log=TransferLog(transfer_log),
                                  lease_valid_for=lease_valid_for,
                                  lease_fence_margin_s=lease_fence_margin_s, rank_writer=rank_writer)

    # ------------------------------------------------------------------ API (any thread)
    def stop(self) -> None:
        super().stop("prefill worker is shutting down")
        self.sender.close()

    def submit(self, job: PrefillJob) -> Future:
        """Queue ``job``; the future gets a ``prefill_pb2.PrefillResult`` once D has the KV and the
        ok notice, or a ``ServiceError``: ALREADY_EXISTS (room in use), ABORTED (room aborted, or
        its destination expired), FAILED_PRECONDITION (room ended), RESOURCE_EXHAUSTED (cannot fit an idle pool), FAILED_PRECONDITION (destination does
        not match), DEADLINE_EXCEEDED (no destination in time), UNAVAILABLE (transfer failed, or
        shutting down), CANCELLED (aborted), INTERNAL (scheduler error)."""
        if not self.known.claim(job):
            job.reply.set_exception(ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                                                 f"room {job.room} is already in use"))
        else:
            self.inbox.post(Submit(job))
        return job.reply

    def open_segment(self, name: str) -> Segment:
        """Open (or reuse) D's segment by name; may block on the registry. The transport serializes
        opens, so racing SetDestination calls for one D share one endpoint."""
        return self.transfer.open_segment(name)

    def offer_destination(self, dest: Destination) -> str | None:
        """Buffer D's destination for the scheduler; None when accepted, else why not (see
        ``DestinationBook.offer``)."""
        why = self.book.offer(dest)
        if why is None:
            self.inbox.post(Wake())
        return why

    def abort(self, room: int, request_id: str, reason: str) -> bool:
        """Queue an abort (never waits for the scheduler, which may be inside a long forward).
        Returns whether this worker knows the room (a request or a buffered destination); an
        unknown room is still tombstoned, so a late Prefill/SetDestination for it is refused."""
        found = self.known.knows(room, request_id) or bool(room) and self.book.holds(room)
        self.inbox.post(Abort(room, request_id, reason))
        return found

    def never_fits(self, prompt_len: int) -> str | None:
        """Why a prompt of ``prompt_len`` tokens can never fit P's pool, or None."""
        pages = pages_for(prompt_len, self.ps)
        if pages > self.alloc.num_pages:
            return (f"prompt of {prompt_len} tokens needs {pages} KV pages; the pool has "
                    f"{self.alloc.num_pages}")
        return None

    # ------------------------------------------------------------------ loop (scheduler thread)
    def idle_wait(self) -> float:
        if self.prefill.prefilling or self.admission.ready():
            return 0.0
        return 0.001 if self.sender.busy() else 0.05

    def handle(self, msg: object) -> None:
        if isinstance(msg, Submit):
            self._accept(msg.job)
        elif isinstance(msg, Abort):
            self._abort(msg)
        elif isinstance(msg, LoadQuery):
            self.answer_load(msg, self._load_report(), self.runner)

    def iterate(self) -> None:
        self.sender.expire()
        self.sender.poll()
        admitted, refused = self.admission.admit()
        for job in admitted:
            self.prefill.add(job)
        if refused is not None:
            n = len(refused.prompt_ids)
            self.fail(refused, ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                            f"prompt of {n} tokens does not fit the KV pool"))
        self.sender.claim()
        self.cpu_share.mark(bool(self.prefill.prefilling))
        self.prefill.step()
        self.cpu_share.mark(bool(self.prefill.prefilling))  # idle at once: D takes the cores back
        self.sender.send_ready()
        self._gauges()

    def on_iteration_error(self) -> None:
        # admitted jobs arrived before every waiting one: this is arrival order
        for job in self.prefill.prefilling + list(self.admission.waiting):
            self.fail(job, ServiceError(grpc.StatusCode.INTERNAL, "prefill scheduler error"))

    def live_jobs(self) -> list:
        return list(self.jobs.values())

    def answer_shutdown(self, job: PrefillJob, err: ServiceError) -> None:
        if not job.reply.done():
            try:
                job.reply.set_exception(err)
            except InvalidStateError:  # answered by the loop in the meantime
                pass

    def _accept(self, job: PrefillJob) -> None:
        refused = (ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"room {job.room} is already in use")
                   if job.room in self.jobs else self.book.refusal(job.room))
        if refused is not None:
            self.known.discard(job)  # only what this job claimed
            job.reply.set_exception(refused)
        else:
            self.jobs[job.room] = job
            self.admission.enqueue(job)
            self.sender.expect(job)
            M.PREFILL_PROMPT_TOKENS.inc(len(job.prompt_ids))

    # ------------------------------------------------------------------ endings (JobEnds)
    def succeed(self, job: PrefillJob) -> None:
        tok, lp, top = job.first
        res = prefill_pb2.PrefillResult(
            room=job.room, first_token_id=tok, first_logprob=token_logprob(tok, lp, top),
            cached_tokens=job.pre_len, pages_sent=job.pages_sent, bytes_sent=job.bytes_sent,
            queue_seconds=job.t_admit - job.arrived, prefill_seconds=job.t_prefilled - job.t_admit,
            transfer_seconds=time.monotonic() - (job.t_transfer or job.t_prefilled))
        self._release(job)
        job.reply.set_result(res)

    def fail(self, job: PrefillJob, err: ServiceError) -> None:
        if job.error is None:
            job.error = err
        if not job.busy:
            self.finish_failed(job)

    def finish_failed(self, job: PrefillJob) -> None:
        if job.state is JobState.DONE:
            return
        if job.dest is not None and not job.notified_ok:
            self.sender.notify_failed(job.dest, str(job.error or job.aborted))
        self._release(job)
        err = job.error or ServiceError(grpc.StatusCode.CANCELLED, f"aborted: {job.aborted}")
        if not job.reply.done():
            job.reply.set_exception(err)

    def _abort(self, msg: Abort) -> None:
        jobs = abort_targets(self.jobs, msg)
        # a room no request holds yet is tombstoned too (its Prefill may still come), unless the
        # abort was for one job's own call: that room belongs to whichever request holds it
        rooms = [j.room for j in jobs] or ([msg.room] if msg.room and msg.job is None else [])
        for room in rooms:
            unclaimed = self.book.abort(room)
            if unclaimed is not None:
                self.sender.notify_failed(unclaimed, f"aborted: {msg.reason}")
        for job in jobs:
            if not job.failed:
                job.aborted = msg.reason or "aborted"
                job.error = ServiceError(grpc.StatusCode.CANCELLED, f"aborted: {job.aborted}")
            if not job.busy:
                self.finish_failed(job)

    def _release(self, job: PrefillJob) -> None:
        """Give back everything the job holds (called once no write reads its pages)."""
        assert not job.busy, "release while a transfer may still read the pages"
        self.admission.release(job)
        job.state = JobState.DONE
        self.known.discard(job)
        if self.jobs.get(job.room) is job:
            del self.jobs[job.room]
        self.admission.discard(job)
        self.prefill.discard(job)
        self.sender.discard(job)
        unclaimed = self.book.release(job.room)
        if unclaimed is not None:  # D's destination arrived but was never used: answer it
            self.sender.notify_failed(unclaimed, str(job.error or "prefill request ended"))

    # ------------------------------------------------------------------ accounting
    def _count(self, *states: JobState) -> int:
        return sum(j.state in states for j in self.jobs.values())

    def _load_report(self) -> common_pb2.LoadReport:
        st = self.cache.stats()
        total = self.alloc.num_pages
        acc = common_pb2.KVAccounting(
            total_pages=total, free_pages=self.alloc.num_free, evictable_pages=st.evictable_pages,
            locked_pages=st.protected_pages, owned_pages=self.admission.owned_pages(self.jobs.values()),
            min_lock_ref=st.min_lock_ref, held_rooms=len(self.jobs) + self.book.held_rooms(),
            held_req_slots=self.r2t.num_used)
        return common_pb2.LoadReport(
            waiting_requests=len(self.admission.waiting),
            running_requests=self._count(JobState.PREFILLING, JobState.WAIT_DEST),
            transferring_requests=self._count(JobState.TRANSFERRING),
            kv_usage=1.0 - self.alloc.num_free / total, accounting=acc)

    def _gauges(self) -> None:
        counts = {"prefilling": self._count(JobState.QUEUED, JobState.PREFILLING),
                  "waiting_destination": self._count(JobState.WAIT_DEST),
                  "transferring": self._count(JobState.TRANSFERRING)}
        for q in M.PREFILL_QUEUES:
            M.PREFILL_QUEUE.labels(queue=q).set(counts[q])
