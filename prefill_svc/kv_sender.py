"""Sending a job's KV delta to D: claim the destination, write the pages, then the notice.

* claim: a job takes D's ``KVDestination`` for its room from the ``DestinationBook`` and checks it
  (``check_destination``); a mismatch fails the job FAILED_PRECONDITION.
* send: logical pages ``[pre_len/ps, ceil(len/ps))`` of the prompt (``pre_len`` is D's prefix hit)
  go to D's ``dst_page_ids`` in order. While the prompt is still being computed only whole computed
  pages go, so a middle chunk never sends a partial last page. Each send is one batch with one
  descriptor per (src, dst) page run per K/V buffer (``kv_runs``).
* notice: after the last batch the ok ``KVNotice`` (first token, sampler state, optional
  per-(page, kv head) checksums, ``pd_common.head_checksums``) is queued with ``send_notify``;
  the transport delivers it only after every earlier batch to that segment completed, and fails
  it if one failed.
* A job's pages stay allocated while any of its batches or its notice may still read them.
* Tensor parallelism (P or D runs several ranks): each batch is a ``RankWriter`` rank batch, one
  write per (P rank, D rank, kv-head range) on the writing rank's engine, one block per page; the
  notice is queued only once every rank batch of the job completed (those writes use several
  endpoints, so the engine's ordering behind one segment's batches does not cover them), and
  carries the kv-head cuts at which D must unblock head-blocked pages (``head_block_cuts``). Its
  checksums are the ones each rank computed of the heads it wrote (``RankWriter.head_sums``),
  gathered batch by batch.

Every accepted destination gets exactly one notice, ok or ok=false (failure, abort, expiry), so D
can keep its destination pages quarantined until then.

Fencing (docs/architecture.md, Fencing one-sided writes): no batch or ok notice is started after the
destination's write window (``Destination.not_after``) or while P's own view of its registry lease
has lapsed; the job fails (DEADLINE_EXCEEDED / UNAVAILABLE) and D gets ok=false instead. The
transfer engine re-checks the window on its progress thread right before the puts. ok=false notices go from a helper thread,
since re-opening a dropped segment may block on the registry.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
import torch

from engine.kvcache.paging import pages_for, pages_of_slots
from pd_common.head_checksums import NoticeSums, head_checksums
from pd_common.kv_transport import KVSender
from pd_common.protocol import ServiceError, token_logprob
from prefill_svc.destinations import DestinationBook, check_destination
from prefill_svc.jobs import Destination, JobEnds, JobState, PendingBatch, PrefillJob
from prefill_svc.kv_runs import PoolGeometry, descriptors, merge_runs
from protos import prefill_pb2
from telemetry import metrics as M
from transfer_svc.engine import WRITE_DEADLINE_PASSED, State

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner
    from prefill_svc.rank_writer import RankWriter

log = logging.getLogger("halfmoon.prefill")


def _failure_code(reason: str) -> grpc.StatusCode:
    """A failed batch's status for the caller: its write window passed, or the transfer failed."""
    return grpc.StatusCode.DEADLINE_EXCEEDED if WRITE_DEADLINE_PASSED in reason else grpc.StatusCode.UNAVAILABLE


class TransferLog:
    """P's JSONL transfer log, one line per submitted batch and per notice (``path`` None: off)."""

    def __init__(self, path: str | None):
        self._f = open(path, "a", buffering=1) if path else None

    @property
    def enabled(self) -> bool:
        return self._f is not None

    def write(self, record: dict) -> None:
        if self._f is not None:
            self._f.write(json.dumps(record) + "\n")


class DeltaSender:
    """Owns the jobs awaiting a destination (arrival order) and the jobs sending to one (claim
    order).

    Args:
        transfer: the transport, with P's pool registered.
        runner: P's model runner (its pool and request rows hold the pages to send).
        geometry: P's pool geometry (as published); book: D's destinations by room.
        ends: how a job ends (the scheduler).
        destination_timeout_s: a job without a destination this long after arrival fails (a job
            whose Prefill call has a deadline waits until that deadline instead)
            DEADLINE_EXCEEDED; checksums: put per-(page, kv head) checksums in every ok notice.
        transfer_log: the JSONL log.
        lease_valid_for: seconds P's registry lease is still certainly held
            (``RegistryClient.lease_valid_for``), or None (no registry: no lease fence).
        lease_fence_margin_s: no write starts while ``lease_valid_for()`` is below this.
        rank_writer: writes to a D of several ranks, or from a P of several (None: neither can
            happen here; a tensor-parallel D is then refused at claim).
    """

    def __init__(self, transfer: KVSender, runner: ModelRunner, geometry: PoolGeometry,
                 book: DestinationBook, ends: JobEnds, *, destination_timeout_s: float,
                 checksums: bool, transfer_log: TransferLog,
                 lease_valid_for: Callable[[], float] | None = None, lease_fence_margin_s: float = 0.0,
                 rank_writer: RankWriter | None = None):
        self.transfer = transfer
        self.runner = runner
        self.ps = runner.page_size
        self.geometry = geometry
        self.book = book
        self.ends = ends
        self.destination_timeout_s = destination_timeout_s
        self.checksums = checksums
        self.log = transfer_log
        self.lease_valid_for = lease_valid_for
        self.lease_fence_margin_s = lease_fence_margin_s
        self.rank_writer = rank_writer
        self.unclaimed: dict[int, PrefillJob] = {}  # room -> job without a destination
        self.sending: dict[int, PrefillJob] = {}    # room -> job with a claimed destination
        self._net = ThreadPoolExecutor(2, thread_name_prefix="prefill-net")

    def expect(self, job: PrefillJob) -> None:
        """A new job; it waits for its destination."""
        self.unclaimed[job.room] = job

    def discard(self, job: PrefillJob) -> None:
        self.unclaimed.pop(job.room, None)
        self.sending.pop(job.room, None)

    def busy(self) -> bool:
        """Some batch or notice is in flight."""
        return any(j.busy for j in self.sending.values())

    def close(self) -> None:
        """Drop ok=false notices not yet sent (shutdown)."""
        self._net.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ destinations
    def expire(self) -> None:
        """Answer destinations unclaimed past the book's TTL; fail jobs that waited too long."""
        for dest in self.book.expire():
            self.notify_failed(dest, "destination expired: no prefill request for this room")
        now = time.monotonic()
        for job in list(self.unclaimed.values()):
            limit = job.destination_deadline if job.destination_deadline is not None \
                else job.arrived + self.destination_timeout_s
            if not job.failed and now > limit:
                self.ends.fail(job, ServiceError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no KV destination from decode within {limit - job.arrived:.3g} s"))

    def claim(self) -> None:
        """Give each waiting job the destination D offered for its room, if one arrived."""
        for job in list(self.unclaimed.values()):
            dest = self.book.take(job.room)
            if dest is None:
                continue
            del self.unclaimed[job.room]
            self.sending[job.room] = job
            job.dest = dest  # also on a mismatch: the failure is answered with an ok=false notice
            why = check_destination(dest, len(job.prompt_ids), self.ps, self.geometry) or self._rank_refusal(dest)
            if why:
                self.ends.fail(job, ServiceError(grpc.StatusCode.FAILED_PRECONDITION, why))
            else:
                job.next_page = int(dest.msg.pre_len) // self.ps

    def _per_rank(self, dest: Destination) -> bool:
        return self.rank_writer is not None and self.rank_writer.per_rank(dest.segment)

    def _wants_sums(self, dest: Destination) -> bool:
        return self.checksums or dest.msg.want_checksums

    def _rank_refusal(self, dest: Destination) -> str | None:
        """Why a tensor-parallel pair cannot take ``dest`` (D's heads do not map onto P's), or None."""
        if dest.segment.kv_layout.tp_size > 1 and self.rank_writer is None:
            return "decode runs tensor-parallel; this prefill worker writes to single-rank pools only"
        if not self._per_rank(dest):
            return None
        return self.rank_writer.refusal(dest.segment)

    # ------------------------------------------------------------------ sending
    def send_ready(self) -> None:
        """Submit every job's newly computed whole pages; queue the ok notice after the last."""
        for job in list(self.sending.values()):
            if job.failed or job.notify_id is not None or job.state is JobState.QUEUED:
                continue
            if job.state is JobState.WAIT_DEST:
                job.state = JobState.TRANSFERRING
            n = len(job.prompt_ids)
            complete = job.computed == n and job.first is not None
            end_page = pages_for(n, self.ps) if complete else job.computed // self.ps
            if job.next_page < end_page or complete:
                fenced = self._fenced(job)
                if fenced is not None:
                    self.ends.fail(job, fenced)
                    continue
            try:
                if job.next_page < end_page:
                    self._submit_pages(job, job.next_page, end_page)
                if complete and job.next_page >= end_page and not any(b.per_rank for b in job.batches.values()):
                    self._queue_notice(job)
            except Exception as e:  # SegmentClosed, BoundsError, ...: nothing was submitted
                M.TRANSFER_FAILURES.labels(reason="peer_unreachable").inc()
                self.ends.fail(job, ServiceError(grpc.StatusCode.UNAVAILABLE,
                                                 f"KV transfer to decode failed: {e}"))

    def _fenced(self, job: PrefillJob) -> ServiceError | None:
        """Why no write of ``job`` may start now (its window passed, P's lease lapsed), or None."""
        not_after = job.dest.not_after
        if not_after is not None and time.monotonic() > not_after:
            M.TRANSFER_FAILURES.labels(reason="timeout").inc()
            return ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"write window of the KV destination passed "
                                f"({job.dest.msg.write_deadline_ms} ms after it arrived)")
        if self.lease_valid_for is not None:
            left = self.lease_valid_for()
            if left < self.lease_fence_margin_s:
                return ServiceError(grpc.StatusCode.UNAVAILABLE,
                                    f"registry lease lapsed or about to ({left:.1f} s left, margin "
                                    f"{self.lease_fence_margin_s:g} s): no KV write starts")
        return None

    def _submit_pages(self, job: PrefillJob, first: int, end: int) -> None:
        """One batch writing logical pages ``[first, end)`` to their destination pages."""
        ps, n, dest = self.ps, len(job.prompt_ids), job.dest
        d0 = int(dest.msg.pre_len) // ps
        r2t = self.runner.req_to_token_pool.req_to_token
        src = pages_of_slots(r2t[job.lease.row, first * ps: min(end * ps, n)], ps)
        dst = [int(p) for p in dest.msg.dst_page_ids[first - d0: end - d0]]
        if not job.t_transfer:
            job.t_transfer = time.monotonic()
        if r2t.device.type == "cuda":  # the forward's KV writes must land before the transport reads
            torch.cuda.current_stream(r2t.device).synchronize()
        record = {"event": "batch", "room": job.room, "request_id": job.request_id,
                  "logical_pages": list(range(first, end)), "src_pages": src, "dst_pages": dst,
                  "pre_len": int(dest.msg.pre_len), "prompt_len": n}
        if self._per_rank(dest):
            sums = self._wants_sums(dest)
            if sums and job.sums is None:
                job.sums = NoticeSums(self.runner.model_config.num_kv_heads)
            bid, nbytes, writes = self.rank_writer.submit(dest.segment, src, dst, dest.not_after, checksums=sums)
            job.batches[bid] = PendingBatch(time.monotonic(), len(src), nbytes, per_rank=True, first_page=first)
            for w in writes:
                M.TRANSFER_RANK_PAGES.labels(src_rank=str(w.src_rank), dst_rank=str(w.dst_rank)).inc(w.pages)
            record["rank_writes"] = [[w.src_rank, w.dst_rank, w.head_start, w.head_end, w.pages, w.descriptors,
                                      int(w.staged), int(w.blocked)] for w in writes]
        else:
            runs = merge_runs(src, dst)
            descs = descriptors(runs, self.geometry, dest.geometry)
            bid = self.transfer.submit(dest.segment, descs, not_after=dest.not_after)
            nbytes = sum(d[2] for d in descs)
            job.batches[bid] = PendingBatch(time.monotonic(), len(src), nbytes)
            M.TRANSFER_RANK_PAGES.labels(src_rank="0", dst_rank="0").inc(len(src))  # one rank each side
            record.update(runs=[[r.src, r.dst, r.length] for r in runs], descriptors=len(descs))
        job.next_page = end
        if self.log.enabled:
            self.log.write({**record, "batch": bid, "bytes": nbytes})

    def _queue_notice(self, job: PrefillJob) -> None:
        notice = self._ok_notice(job)
        job.notify_id = self.transfer.send_notify(job.dest.segment, notice.SerializeToString(),
                                                  not_after=job.dest.not_after)
        self.log.write({"event": "notice", "room": job.room, "ok": True, "pages_sent": notice.pages_sent})

    def _ok_notice(self, job: PrefillJob) -> prefill_pb2.KVNotice:
        pending = sum(b.pages for b in job.batches.values())
        notice = prefill_pb2.KVNotice(room=job.room, ok=True, cached_tokens=job.pre_len,
                                      pages_sent=job.pages_sent + pending)
        tok, lp, top = job.first
        notice.first_token_id = tok
        notice.first_logprob.CopyFrom(token_logprob(tok, lp, top))
        notice.sampler_state = job.rng_state
        notice.samples.extend(job.samples)
        if self._per_rank(job.dest):  # D rewrites its head-blocked pages at these cuts before the commit
            notice.head_block_cuts.extend(self.rank_writer.head_cuts(job.dest.segment))
        if self._wants_sums(job.dest):
            notice.head_checksums.extend(self._delta_sums(job))
        return notice

    def _delta_sums(self, job: PrefillJob) -> list[int]:
        """The delta's per-(page, kv head) checksums, page-major over every kv head.

        Raises:
            ValueError: a rank's replies lacked some head's sums (the job fails).
        """
        first, end = int(job.dest.msg.pre_len) // self.ps, pages_for(len(job.prompt_ids), self.ps)
        if job.sums is not None:  # rank batches: each head summed by the rank that wrote it
            return job.sums.flat(first, end)
        r2t = self.runner.req_to_token_pool.req_to_token
        slots = r2t[job.lease.row, int(job.dest.msg.pre_len): len(job.prompt_ids)]  # D's delta
        return [crc for row in head_checksums(self.runner.kv_pool, pages_of_slots(slots, self.ps)) for crc in row]

    # ------------------------------------------------------------------ completion
    def poll(self) -> None:
        """Collect finished batches and notices; end the jobs they complete or fail."""
        for job in list(self.sending.values()):
            for bid, batch in list(job.batches.items()):
                transport = self.rank_writer if batch.per_rank else self.transfer
                st = transport.status(bid)
                if st.state is State.PENDING:
                    continue
                del job.batches[bid]
                if st.state is State.COMPLETED and batch.per_rank and job.sums is not None:
                    job.sums.add(batch.first_page, self.rank_writer.head_sums(bid))
                transport.release(bid)
                # bytes, batch seconds and failures are counted by the transfer engine itself
                if st.state is State.COMPLETED:
                    M.TRANSFER_PAGES.inc(batch.pages)
                    job.pages_sent += batch.pages
                    job.bytes_sent += batch.nbytes
                elif not job.failed:
                    job.error = ServiceError(_failure_code(st.reason), f"KV transfer failed: {st.reason}")
            if job.notify_id is not None and not job.batches:
                st = self.transfer.status(job.notify_id)
                if st.state is State.PENDING:
                    continue
                self.transfer.release(job.notify_id)
                job.notify_id = None
                if st.state is State.COMPLETED:
                    job.notified_ok = True
                    if job.error is None:
                        self.ends.succeed(job)
                        continue
                elif not job.failed:
                    job.error = ServiceError(_failure_code(st.reason), f"KV notice failed: {st.reason}")
            if job.failed and not job.busy:
                self.ends.finish_failed(job)

    def notify_failed(self, dest: Destination, error: str) -> None:
        """Send D an ok=false notice for ``dest`` from a helper thread (never raises)."""
        payload = prefill_pb2.KVNotice(room=dest.room, ok=False, error=error).SerializeToString()
        self.log.write({"event": "notice", "room": dest.room, "ok": False, "error": error})

        def send():
            seg = dest.segment
            try:
                if not seg.alive:
                    seg = self.transfer.open_segment(seg.name)
                self.transfer.wait(self.transfer.send_notify(seg, payload), timeout_s=10)
            except Exception as e:  # D is gone: its own timeout / registry watch covers it
                log.info("ok=false notice for room %d not delivered: %s", dest.room, e)

        self._net.submit(send)
