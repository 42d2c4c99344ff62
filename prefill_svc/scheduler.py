"""Prefill scheduler: one thread drives the ModelRunner; gRPC threads talk to it through a queue.

A job's path (DESIGN.md §3 step 3, anchors §1.5-1.11):

  QUEUED ─admit─> PREFILLING ─last chunk─> WAIT_DEST ─destination─> TRANSFERRING ─notice─> done
                    (chunks; pages are sent as soon as a destination is known)

* admit: match the prompt in P's radix cache (capped at ``len - 1`` tokens: the last token's logits
  are needed), lock the prefix, allocate pages for the rest (evicting unlocked radix pages if short).
* prefill: chunked extend batches of at most ``chunked_prefill_size`` tokens over all prefilling jobs;
  the job that finishes its prompt samples the first output token.
* send: logical pages ``[pre_len/ps, ceil(len/ps))`` go to D's ``dst_page_ids`` in order. While the
  prompt is still being computed only whole computed pages go (a middle chunk never sends a partial
  last page); each send is one batch with one descriptor per (src, dst) run per K/V buffer
  (``kv_runs``). After the last batch the completion notice (``KVNotice``) is queued with
  ``send_notify``; the transfer engine delivers it only after every earlier batch to that segment
  completed, and fails it if one failed.
* release (every exit: success, failure, abort, timeout): only once no batch of the job is
  pending (source pages stay pinned while read), insert the computed full pages into the radix
  cache, free duplicates and the tail, unlock the prefix, free the row.

Every accepted destination gets exactly one notice (ok, or ok=false on failure/abort/expiry), so D
can keep its destination pages quarantined until then.
"""

from __future__ import annotations

import enum
import json
import logging
import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.kvcache.radix_cache import RadixCache
from engine.sampler import make_generator, sample
from engine.sampling_params import SamplingParams
from telemetry import metrics as M
from prefill_svc.destinations import DestinationBook, check_destination
from prefill_svc.kv_runs import PoolGeometry, descriptors, merge_runs
from pd_common.protocol import ServiceError, drain_jobs, kv_layout, page_checksums, token_logprob
from pd_common.worker_runtime import bind_cuda_device
from protos import common_pb2, prefill_pb2
from transfer_svc.engine import State

log = logging.getLogger("halfmoon.prefill")


class JobState(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    WAIT_DEST = "waiting_destination"
    TRANSFERRING = "transferring"
    DONE = "done"


@dataclass(eq=False)
class Destination:
    """An accepted KVDestination with D's opened segment and pool geometry."""

    msg: prefill_pb2.KVDestination
    segment: object  # transfer_svc.engine.Segment
    geometry: PoolGeometry

    @property
    def room(self) -> int:
        return int(self.msg.room)


@dataclass(eq=False)
class PrefillJob:
    request_id: str
    room: int
    ids: list[int]
    params: SamplingParams
    arrived: float = field(default_factory=time.monotonic)
    reply: Future = field(default_factory=Future)
    state: JobState = JobState.QUEUED
    row: int | None = None
    node: object = None            # locked radix node of P's prefix
    cached: int = 0                # P's prefix hit (tokens, page-aligned)
    own_pages: list[int] = field(default_factory=list)  # logical pages cached/ps .. in order
    computed: int = 0              # tokens with KV in the pool
    dest: Destination | None = None
    next_page: int = 0             # next logical page to send
    batches: dict = field(default_factory=dict)  # batch id -> submit time (pending)
    notify_id: int | None = None
    pages_sent: int = 0
    bytes_sent: int = 0
    first: tuple | None = None     # (token, logprob, top)
    rng_state: bytes = b""
    error: ServiceError | None = None
    aborted: str = ""
    notified_ok: bool = False      # D received the ok notice (no ok=false notice after it)
    t_admit: float = 0.0
    t_prefilled: float = 0.0
    t_transfer: float = 0.0

    @property
    def busy(self) -> bool:
        """Some write of this job may still read its pages."""
        return bool(self.batches) or self.notify_id is not None


class PrefillScheduler:
    """Owns the ModelRunner, P's radix cache and every job; see the module docstring.

    Args:
        runner: ``engine.model_runner.ModelRunner``.
        transfer: ``transfer_svc.engine.TransferEngine`` with the pool registered.
        destination_timeout_s: a job without a destination this long after arrival fails
            (DEADLINE_EXCEEDED); an unclaimed destination is dropped after the same time.
        transfer_log: path of a JSONL file, one line per submitted batch and per notice, or None.
    """

    def __init__(self, runner, transfer, *, destination_timeout_s: float = 60.0,
                 transfer_log: str | None = None, checksums: bool = False,
                 disable_radix_cache: bool = False):
        self.runner = runner
        self.transfer = transfer
        self.ps = runner.page_size
        self.alloc = runner.allocator
        self.r2t = runner.req_to_token_pool
        self.cache = None if disable_radix_cache else RadixCache(self.ps, self.alloc)
        self.chunk = runner.config.chunked_prefill_size
        self.destination_timeout_s = destination_timeout_s
        self.book = DestinationBook(destination_timeout_s)
        self.checksums = checksums
        # the same description of this pool that the worker publishes (pd_common.protocol.kv_layout)
        self.geometry = PoolGeometry.from_layout(kv_layout(runner.kv_pool, runner.config.model))
        self._log = open(transfer_log, "a", buffering=1) if transfer_log else None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[int, PrefillJob] = {}  # room -> job
        self._order: list[PrefillJob] = []      # admission order
        self._net = ThreadPoolExecutor(2, thread_name_prefix="prefill-net")
        self._known_lock = threading.Lock()   # rooms / request ids with a job (for Abort answers)
        self._known: set[int] = set()
        self._rids: dict[str, int] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="prefill-scheduler", daemon=True)

    # ------------------------------------------------------------------ API (any thread)
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._inbox.put(("wake",))
        self._thread.join(timeout=10)
        self._net.shutdown(wait=False, cancel_futures=True)
        # Answer every caller still waiting: a gRPC thread blocked on a reply would keep the
        # process from exiting after SIGTERM.
        err = ServiceError(grpc.StatusCode.UNAVAILABLE, "prefill worker is shutting down")
        for job in self._order + drain_jobs(self._inbox):
            if not job.reply.done():
                try:
                    job.reply.set_exception(err)
                except InvalidStateError:  # answered by the loop in the meantime
                    pass

    def submit(self, job: PrefillJob) -> Future:
        with self._known_lock:
            self._known.add(job.room)
            self._rids[job.request_id] = job.room
        self._inbox.put(("job", job))
        return job.reply

    def open_segment(self, name: str):
        """Open (or reuse) D's segment by name; may block on the registry. The transfer engine
        serializes opens, so racing SetDestination calls for one D share one endpoint."""
        return self.transfer.open_segment(name)

    def offer_destination(self, dest: Destination) -> str | None:
        why = self.book.offer(dest)
        if why is None:
            self._inbox.put(("wake",))
        return why

    def abort(self, room: int, request_id: str, reason: str) -> bool:
        """Queue an abort (never waits for the scheduler, which may be inside a long forward).
        Returns whether this worker knows the room (a request or a buffered destination); an
        unknown room is still tombstoned, so a late Prefill/SetDestination for it is refused."""
        with self._known_lock:
            room = room or self._rids.get(request_id, 0)
            found = room in self._known
        if room:
            found = self.book.holds(room) or found
        self._inbox.put(("abort", room, request_id, reason, None))
        return found

    def load(self) -> common_pb2.LoadReport:
        fut: Future = Future()
        self._inbox.put(("load", fut))
        return fut.result(timeout=60)

    def never_fits(self, prompt_len: int) -> str | None:
        pages = -(-prompt_len // self.ps)
        if pages > self.alloc.num_pages:
            return (f"prompt of {prompt_len} tokens needs {pages} KV pages; the pool has "
                    f"{self.alloc.num_pages}")
        return None

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        bind_cuda_device(self.runner.device)  # this thread runs the forwards (CUDA graph replay)
        while not self._stop:
            try:
                self._drain(self._idle_wait())
                self._expire()
                self._poll_transfers()
                self._admit()
                self._claim_destinations()
                self._prefill_step()
                self._send_ready()
                self._gauges()
            except Exception:  # never let the loop die; fail what is in flight loudly
                log.exception("prefill scheduler iteration failed")
                for job in list(self._order):
                    if job.state in (JobState.QUEUED, JobState.PREFILLING):
                        self._fail(job, ServiceError(grpc.StatusCode.INTERNAL, "prefill scheduler error"))

    def _idle_wait(self) -> float:
        if any(j.state in (JobState.QUEUED, JobState.PREFILLING) for j in self._order):
            return 0.0
        if any(j.busy for j in self._order):
            return 0.001
        return 0.05

    def _drain(self, wait: float) -> None:
        try:
            msg = self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind = msg[0]
            if kind == "job":
                job = msg[1]
                if job.room in self._jobs or self.book.is_aborted(job.room):
                    if job.room not in self._jobs:
                        self._forget(job)
                    job.reply.set_exception(ServiceError(
                        grpc.StatusCode.ALREADY_EXISTS if job.room in self._jobs else grpc.StatusCode.ABORTED,
                        f"room {job.room} is already in use" if job.room in self._jobs
                        else f"room {job.room} was aborted"))
                else:
                    self._jobs[job.room] = job
                    self._order.append(job)
                    M.PREFILL_PROMPT_TOKENS.inc(len(job.ids))
            elif kind == "abort":
                _, room, rid, reason, fut = msg
                found = self._abort(room, rid, reason)
                if fut is not None:
                    fut.set_result(found)
            elif kind == "load":
                msg[1].set_result(self._load_report())
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    # ------------------------------------------------------------------ stages
    def _admit(self) -> None:
        for job in list(self._order):
            if job.state is not JobState.QUEUED:
                continue
            row = self.r2t.alloc()
            if row is None:
                return
            n = len(job.ids)
            if self.cache is not None:
                slots, node = self.cache.match_prefix(job.ids[: n - 1])
                self.cache.inc_lock_ref(node)
            else:
                slots, node = torch.empty(0, dtype=torch.int64), None
            cached = slots.numel()
            need = -(-n // self.ps) - cached // self.ps
            if self.alloc.num_free < need and self.cache is not None:
                self.cache.evict(need - self.alloc.num_free)
            pages = self.alloc.alloc(need)
            if pages is None:
                if node is not None:
                    self.cache.dec_lock_ref(node)
                self.r2t.free(row)
                if not any(j.row is not None for j in self._order):
                    self._fail(job, ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                 f"prompt of {n} tokens does not fit the KV pool"))
                return  # FIFO: wait for pages
            job.row, job.node, job.cached, job.own_pages = row, node, cached, pages
            job.computed = cached
            self.r2t.write(row, 0, slots)
            pg = torch.tensor(pages, dtype=torch.int64)
            own = (pg[:, None] * self.ps + torch.arange(self.ps)[None, :]).reshape(-1)[: n - cached]
            self.r2t.write(row, cached, own)
            job.state = JobState.PREFILLING
            job.t_admit = time.monotonic()
            M.PREFILL_CACHED_TOKENS.inc(cached)

    def _claim_destinations(self) -> None:
        for job in list(self._order):
            if job.dest is None and job.state in (JobState.QUEUED, JobState.PREFILLING, JobState.WAIT_DEST):
                dest = self.book.take(job.room)
                if dest is None:
                    continue
                why = check_destination(dest, len(job.ids), self.ps, self.geometry)
                if why:
                    job.dest = dest  # so the failure is answered with an ok=false notice
                    self._fail(job, ServiceError(grpc.StatusCode.FAILED_PRECONDITION, why))
                    continue
                job.dest = dest
                job.next_page = int(dest.msg.pre_len) // self.ps

    def _prefill_step(self) -> None:
        jobs, toks, budget = [], [], self.chunk
        for job in list(self._order):
            if job.state is JobState.PREFILLING and job.computed < len(job.ids) and budget > 0:
                take = min(len(job.ids) - job.computed, budget)
                jobs.append(job)
                toks.append(job.ids[job.computed: job.computed + take])
                budget -= take
        if not jobs:
            return
        rows = [j.row for j in jobs]
        pre = [j.computed for j in jobs]
        loc = torch.cat([self.r2t.req_to_token[j.row, j.computed: j.computed + len(t)]
                         for j, t in zip(jobs, toks)])
        batch = ForwardBatch.build(ForwardMode.EXTEND, rows, pre, toks, loc, self.runner.device)
        t0 = time.monotonic()
        logits = self.runner.forward(batch)
        M.PREFILL_COMPUTE_SECONDS.observe(time.monotonic() - t0)
        M.PREFILL_BATCH_SIZE.observe(len(jobs))
        M.PREFILL_BATCH_TOKENS.observe(sum(len(t) for t in toks))
        done = []
        for i, (job, t) in enumerate(zip(jobs, toks)):
            job.computed += len(t)
            if job.computed == len(job.ids):
                done.append((i, job))
        if not done:
            return
        gens = [make_generator(j.params.seed, self.runner.device) if not j.params.greedy else None
                for _, j in done]  # on the logits' device (torch.multinomial needs it there)
        out = sample(logits[[i for i, _ in done]], [j.params for _, j in done], gens,
                     [j.ids for _, j in done], [[] for _ in done])
        for k, (_, job) in enumerate(done):
            job.first = (out.token_ids[k], out.logprobs[k], out.top_logprobs[k])
            if gens[k] is not None:
                job.rng_state = bytes(gens[k].get_state().numpy().tobytes())
            job.t_prefilled = time.monotonic()
            job.state = JobState.TRANSFERRING if job.dest is not None else JobState.WAIT_DEST

    def _send_ready(self) -> None:
        for job in list(self._order):
            if job.dest is None or job.error is not None or job.aborted or job.notify_id is not None:
                continue
            if job.state not in (JobState.PREFILLING, JobState.WAIT_DEST, JobState.TRANSFERRING):
                continue
            if job.state is JobState.WAIT_DEST:
                job.state = JobState.TRANSFERRING
            n = len(job.ids)
            complete = job.computed == n and job.first is not None
            end_page = -(-n // self.ps) if complete else job.computed // self.ps
            try:
                if job.next_page < end_page:
                    self._submit_pages(job, job.next_page, end_page)
                if complete and job.next_page >= end_page:
                    self._queue_notice(job)
            except Exception as e:  # SegmentClosed, BoundsError, ...
                M.TRANSFER_FAILURES.labels(reason="peer_unreachable").inc()  # nothing was submitted
                self._fail(job, ServiceError(grpc.StatusCode.UNAVAILABLE, f"KV transfer to decode failed: {e}"))

    def _submit_pages(self, job: PrefillJob, first: int, end: int) -> None:
        ps, n = self.ps, len(job.ids)
        d0 = int(job.dest.msg.pre_len) // ps
        src = self.r2t.req_to_token[job.row, first * ps: min(end * ps, n)][::ps] // ps
        src = src.tolist()
        dst = [int(p) for p in job.dest.msg.dst_page_ids[first - d0: end - d0]]
        runs = merge_runs(src, dst)
        descs = descriptors(runs, self.geometry, job.dest.geometry)
        if not job.t_transfer:
            job.t_transfer = time.monotonic()
        dev = self.r2t.req_to_token.device
        if dev.type == "cuda":  # the forward's KV writes must land before UCX reads the pages
            torch.cuda.current_stream(dev).synchronize()
        bid = self.transfer.submit(job.dest.segment, descs)
        nbytes = sum(d[2] for d in descs)
        job.batches[bid] = (time.monotonic(), len(src), nbytes)
        job.next_page = end
        if self._log:
            self._log.write(json.dumps({
                "event": "batch", "room": job.room, "request_id": job.request_id, "batch": bid,
                "logical_pages": list(range(first, end)), "src_pages": src, "dst_pages": dst,
                "runs": [[r.src, r.dst, r.length] for r in runs], "descriptors": len(descs),
                "bytes": nbytes, "pre_len": int(job.dest.msg.pre_len), "prompt_len": n}) + "\n")

    def _notice(self, job: PrefillJob, ok: bool, error: str = "") -> prefill_pb2.KVNotice:
        notice = prefill_pb2.KVNotice(room=job.room, ok=ok, error=error, cached_tokens=job.cached,
                                      pages_sent=job.pages_sent + sum(b[1] for b in job.batches.values()))
        if ok and job.first is not None:
            tok, lp, top = job.first
            notice.first_token_id = tok
            notice.first_logprob.CopyFrom(token_logprob(tok, lp, top))
            notice.sampler_state = job.rng_state
            if self.checksums or job.dest.msg.want_checksums:
                d0 = int(job.dest.msg.pre_len) // self.ps
                n = len(job.ids)
                src = (self.r2t.req_to_token[job.row, d0 * self.ps: n][::self.ps] // self.ps).tolist()
                notice.page_checksums.extend(page_checksums(self.runner.kv_pool, src))
        return notice

    def _queue_notice(self, job: PrefillJob) -> None:
        notice = self._notice(job, True)
        job.notify_id = self.transfer.send_notify(job.dest.segment, notice.SerializeToString())
        if self._log:
            self._log.write(json.dumps({"event": "notice", "room": job.room, "ok": True,
                                        "pages_sent": notice.pages_sent}) + "\n")

    def _poll_transfers(self) -> None:
        for job in list(self._order):
            for bid, (t0, pages, nbytes) in list(job.batches.items()):
                st = self.transfer.status(bid)
                if st.state is State.PENDING:
                    continue
                del job.batches[bid]
                self.transfer.release(bid)
                # bytes, batch seconds and failures are counted by the transfer engine itself
                if st.state is State.COMPLETED:
                    M.TRANSFER_PAGES.inc(pages)
                    job.pages_sent += pages
                    job.bytes_sent += nbytes
                else:
                    if job.error is None and not job.aborted:
                        job.error = ServiceError(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {st.reason}")
            if job.notify_id is not None and not job.batches:
                st = self.transfer.status(job.notify_id)
                if st.state is State.PENDING:
                    continue
                self.transfer.release(job.notify_id)
                job.notify_id = None
                if st.state is State.COMPLETED:
                    job.notified_ok = True
                    if job.error is None:
                        self._succeed(job)
                        continue
                elif job.error is None and not job.aborted:
                    job.error = ServiceError(grpc.StatusCode.UNAVAILABLE, f"KV notice failed: {st.reason}")
            if (job.error is not None or job.aborted) and not job.busy:
                self._finish_failed(job)

    def _expire(self) -> None:
        for dest in self.book.expire():
            self._notify_failed_async(dest, "destination expired: no prefill request for this room")
        now = time.monotonic()
        for job in list(self._order):
            if job.dest is None and job.error is None and not job.aborted \
                    and now - job.arrived > self.destination_timeout_s:
                self._fail(job, ServiceError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no KV destination from decode within {self.destination_timeout_s:g} s"))

    # ------------------------------------------------------------------ endings
    def _succeed(self, job: PrefillJob) -> None:
        tok, lp, top = job.first
        res = prefill_pb2.PrefillResult(
            room=job.room, first_token_id=tok, first_logprob=token_logprob(tok, lp, top),
            cached_tokens=job.cached, pages_sent=job.pages_sent, bytes_sent=job.bytes_sent,
            queue_seconds=job.t_admit - job.arrived, prefill_seconds=job.t_prefilled - job.t_admit,
            transfer_seconds=time.monotonic() - (job.t_transfer or job.t_prefilled))
        self._release(job)
        job.reply.set_result(res)

    def _fail(self, job: PrefillJob, err: ServiceError) -> None:
        """Record the failure; the job is released once no write of it is pending."""
        if job.error is None:
            job.error = err
        if not job.busy:
            self._finish_failed(job)

    def _finish_failed(self, job: PrefillJob) -> None:
        if job.state is JobState.DONE:
            return
        if job.dest is not None and not job.notified_ok:
            self._notify_failed_async(job.dest, str(job.error or job.aborted))
        self._release(job)
        err = job.error or ServiceError(grpc.StatusCode.CANCELLED, f"aborted: {job.aborted}")
        if not job.reply.done():
            job.reply.set_exception(err)

    def _abort(self, room: int, request_id: str, reason: str) -> bool:
        job = self._jobs.get(room) if room else next(
            (j for j in self._order if j.request_id == request_id), None)
        if job is None:
            dest = self.book.abort(room) if room else None
            if dest is not None:
                self._notify_failed_async(dest, f"aborted: {reason}")
            return dest is not None
        unclaimed = self.book.abort(job.room)
        if unclaimed is not None:
            self._notify_failed_async(unclaimed, f"aborted: {reason}")
        if not job.aborted and job.error is None:
            job.aborted = reason or "aborted"
            job.error = ServiceError(grpc.StatusCode.CANCELLED, f"aborted: {job.aborted}")
        if not job.busy:
            self._finish_failed(job)
        return True

    def _notify_failed_async(self, dest: Destination, error: str) -> None:
        """ok=false notice to D, on a helper thread (re-opening a dropped segment may block)."""
        payload = prefill_pb2.KVNotice(room=dest.room, ok=False, error=error).SerializeToString()
        if self._log:
            self._log.write(json.dumps({"event": "notice", "room": dest.room, "ok": False,
                                        "error": error}) + "\n")

        def send():
            seg = dest.segment
            try:
                if not seg.alive:
                    seg = self.open_segment(seg.name)
                self.transfer.wait(self.transfer.send_notify(seg, payload), timeout_s=10)
            except Exception as e:  # D is gone: its own timeout / registry watch covers it
                log.info("ok=false notice for room %d not delivered: %s", dest.room, e)

        self._net.submit(send)

    def _release(self, job: PrefillJob) -> None:
        """Give back everything the job holds (called once no write reads its pages)."""
        assert not job.busy, "release while a transfer may still read the pages"
        if job.row is not None:
            own_first = job.cached // self.ps
            kept = range(0)  # own logical pages now in the tree
            if self.cache is not None:
                kept = self.cache.insert_finished(job.ids[:job.computed], self.r2t.req_to_token[job.row],
                                                  own_first)
            free = [p for i, p in enumerate(job.own_pages, start=own_first) if i not in kept]
            if free:
                self.alloc.free(free)
            job.own_pages = []
            if job.node is not None:
                self.cache.dec_lock_ref(job.node)
                job.node = None
            self.r2t.free(job.row)
            job.row = None
        job.state = JobState.DONE
        self._forget(job)
        self._jobs.pop(job.room, None)
        if job in self._order:
            self._order.remove(job)
        unclaimed = self.book.release(job.room)
        if unclaimed is not None:  # D's destination arrived but was never used: answer it
            self._notify_failed_async(unclaimed, str(job.error or "prefill request ended"))

    def _forget(self, job: PrefillJob) -> None:
        with self._known_lock:
            self._known.discard(job.room)
            if self._rids.get(job.request_id) == job.room:
                del self._rids[job.request_id]

    # ------------------------------------------------------------------ accounting
    def _load_report(self) -> common_pb2.LoadReport:
        owned = sum(len(j.own_pages) for j in self._order)
        if self.cache is not None:
            st = self.cache.stats()
            evictable, locked, min_ref = st.evictable_pages, st.protected_pages, st.min_lock_ref
        else:
            evictable = locked = min_ref = 0
        total = self.alloc.num_pages
        acc = common_pb2.KVAccounting(
            total_pages=total, free_pages=self.alloc.num_free, evictable_pages=evictable,
            locked_pages=locked, owned_pages=owned, min_lock_ref=min_ref,
            held_rooms=len(self._jobs) + self.book.held_rooms(), held_req_slots=self.r2t.num_used)
        return common_pb2.LoadReport(
            waiting_requests=sum(j.state is JobState.QUEUED for j in self._order),
            running_requests=sum(j.state in (JobState.PREFILLING, JobState.WAIT_DEST) for j in self._order),
            transferring_requests=sum(j.state is JobState.TRANSFERRING for j in self._order),
            kv_usage=1.0 - self.alloc.num_free / total, accounting=acc)

    def _gauges(self) -> None:
        counts = {q: 0 for q in M.PREFILL_QUEUES}
        for j in self._order:
            if j.state is JobState.PREFILLING or j.state is JobState.QUEUED:
                counts["prefilling"] += 1
            elif j.state is JobState.WAIT_DEST:
                counts["waiting_destination"] += 1
            elif j.state is JobState.TRANSFERRING:
                counts["transferring"] += 1
        for q, c in counts.items():
            M.PREFILL_QUEUE.labels(queue=q).set(c)

