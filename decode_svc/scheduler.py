"""Decode scheduler: pre-allocation, KV wait, commit and the continuous decode batch, in one thread.

A request's path (DESIGN.md §3 steps 2, 4, 5; anchors §1.5, §1.7):

  PREALLOC ─pages─> TRANSFER ─notice ok─> WAITING ─slot in batch─> RUNNING ─finish─> done

* pre-allocate (FIFO, when a row and pages are free, evicting unlocked radix pages if short):
  radix-match the prompt (full pages only; a page-aligned, fully cached prompt needs nothing from P
  since D then holds the KV of every prompt token), lock the prefix, allocate pages for the delta
  *and* the request's decode tokens (``prompt + max_tokens - 1`` KV slots; D never preempts), write
  the row ``[prefix_locs | delta_locs]``, and send ``KVDestination`` (delta page ids only) to P from
  a network thread — the scheduler never blocks on the network.
* commit on P's notice: room and page count (and checksums with ``--kv-checksums``) checked over the
  prebuilt batch's ``out_cache_loc = req_to_token[row, pre_len : prompt_len]``; the prompt's full
  pages go into the radix cache; P's first token is appended and streamed.
* decode: one DECODE forward for every running request per step; tokens stream as they come.
* finish: committed tokens into the radix cache, duplicates and tail freed, prefix unlocked.

Pages P may still write are never reused early: a request that ends before its notice (abort,
timeout, P failure) moves its destination pages to quarantine, released when P's notice for the
room arrives (P answers every accepted destination exactly once), when P's segment incarnation is
gone, or after a fence timeout.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
import torch

from decode_svc.prebuilt import delta_pages, prebuilt_out_cache_loc
from engine.forward_batch import ForwardBatch
from engine.kvcache.radix_cache import RadixCache
from engine.sampler import make_generator, sample
from engine.sampling_params import SamplingParams
from telemetry import metrics as M
from pd_common.protocol import ServiceError, drain_jobs, page_checksums, token_logprob
from pd_common.worker_runtime import bind_cuda_device
from protos import common_pb2, decode_pb2, prefill_pb2

log = logging.getLogger("halfmoon.decode")


class JobState(enum.Enum):
    PREALLOC = "prealloc"
    TRANSFER = "transfer"
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)
class DecodeJob:
    request_id: str
    room: int
    ids: list[int]
    params: SamplingParams
    prefill_address: str
    prefill_worker_id: str = ""    # optional (router): P's segment name, for liveness before P answers
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # DecodeChunk | ServiceError | None
    state: JobState = JobState.PREALLOC
    arrived: float = field(default_factory=time.monotonic)
    detok: object = None           # engine.detokenizer.IncrementalDetokenizer when stop strings are set
    row: int | None = None
    node: object = None            # locked radix node
    pre_len: int = 0               # D's radix hit (tokens)
    tree_len: int = 0              # tokens of the row held by the radix tree (locked via node)
    own: list[int] = field(default_factory=list)  # own pages, logical pages tree_len/ps ...
    alloc_len: int = 0             # slots written in the row
    dst_pages: list[int] = field(default_factory=list)
    dest_state: str = "none"       # none | sending | accepted | rejected | unknown
    prefill_segment: str = ""
    prefill_incarnation: str = ""
    t_prealloc: float = 0.0
    kv_len: int = 0
    output_ids: list[int] = field(default_factory=list)
    generator: object = None
    cached_tokens: int = 0
    pages_transferred: int = 0
    bytes_transferred: int = 0
    finish_reason: str = ""
    matched_stop: str = ""
    aborted: str = ""


@dataclass(eq=False)
class InFlight:
    """A decode step launched on the device whose tokens the host has not read yet (overlap schedule).

    ``tokens_dev``: int64 [B] sampled ids on the device (the next step's input ids); ``tokens_host``:
    int64 [B] their host copy (pinned on CUDA), valid once ``copied`` (a CUDA event; None on CPU)
    has completed; ``pos``: id(job) -> index in ``jobs``.
    """

    jobs: list
    tokens_dev: torch.Tensor
    tokens_host: torch.Tensor
    copied: object
    pos: dict


@dataclass(eq=False)
class Quarantined:
    room: int
    pages: list[int]
    prefill_address: str
    prefill_segment: str
    prefill_incarnation: str
    since: float = field(default_factory=time.monotonic)


class DecodeScheduler:
    """Owns the ModelRunner, D's radix cache, every job and the quarantine.

    Args:
        runner: ``engine.model_runner.ModelRunner`` (rows = 2 x max_running: pre-allocated and
            transferring requests do not take running slots, anchors §1.5).
        transfer: ``transfer_svc.engine.TransferEngine`` (notices arrive through it).
        net: ``decode_svc.peers.PrefillPeers`` (SetDestination / Abort / liveness, own threads).
        segment_name: D's segment name (sent to P in the destination).
        eos_token_ids: stop ids of the model; tokenizer: for stop strings (None: rejected).
        kv_wait_timeout_s: a request waiting for KV this long fails (DEADLINE_EXCEEDED).
        fence_timeout_s: quarantined pages with no notice and a live P are released after this.
        overlap_schedule: launch decode step n+1 before reading step n's tokens, so the GPU computes
            while the host streams the previous tokens (sglang's overlap scheduler). Used for batches
            of greedy requests without penalties or logprobs; other batches run synchronously.
    """

    def __init__(self, runner, transfer, net, *, segment_name: str, eos_token_ids,
                 tokenizer=None, max_running: int = 32, disable_radix_cache: bool = False,
                 checksums: bool = False, kv_wait_timeout_s: float = 60.0,
                 fence_timeout_s: float | None = None, liveness_interval_s: float = 1.0,
                 overlap_schedule: bool = False):
        self.runner = runner
        self.transfer = transfer
        self.net = net
        self.segment_name = segment_name
        self.eos = set(eos_token_ids)
        self.tokenizer = tokenizer
        self.max_running = max_running
        self.ps = runner.page_size
        self.alloc = runner.allocator
        self.r2t = runner.req_to_token_pool
        self.cache = None if disable_radix_cache else RadixCache(self.ps, self.alloc)
        self.checksums = checksums
        self.kv_wait_timeout_s = kv_wait_timeout_s
        self.fence_timeout_s = fence_timeout_s if fence_timeout_s is not None else 2 * kv_wait_timeout_s
        self.liveness_interval_s = liveness_interval_s
        self.overlap_schedule = overlap_schedule
        self._inflight: InFlight | None = None
        self._free_after_step: list[tuple[DecodeJob, bool]] = []  # releases of jobs in the step in flight
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[int, DecodeJob] = {}
        self._order: list[DecodeJob] = []
        self._quarantine: dict[int, Quarantined] = {}
        self._known_lock = threading.Lock()
        self._known: set[int] = set()
        self._rids: dict[str, int] = {}
        self._stop = False
        self._last_liveness = 0.0
        self._thread = threading.Thread(target=self._loop, name="decode-scheduler", daemon=True)
        self._notice_thread = threading.Thread(target=self._notice_pump, name="decode-notices",
                                               daemon=True)

    # ------------------------------------------------------------------ API (any thread)
    def start(self) -> None:
        self._thread.start()
        self._notice_thread.start()

    def stop(self) -> None:
        self._stop = True
        self._inbox.put(("wake",))
        self._thread.join(timeout=10)
        # End every open stream: a gRPC thread blocked on job.out would keep the process from
        # exiting after SIGTERM.
        err = ServiceError(grpc.StatusCode.UNAVAILABLE, "decode worker is shutting down")
        for job in self._order + drain_jobs(self._inbox):
            if not job.finish_reason:
                job.out.put(err)

    def submit(self, job: DecodeJob) -> None:
        with self._known_lock:
            self._known.add(job.room)
            self._rids[job.request_id] = job.room
        self._inbox.put(("job", job))

    def abort(self, room: int, request_id: str, reason: str) -> bool:
        """Queue an abort (never waits for the scheduler); returns whether the request is known."""
        with self._known_lock:
            room = room or self._rids.get(request_id, 0)
            found = room in self._known
        self._inbox.put(("abort", room, request_id, reason, None))
        return found

    def load(self) -> common_pb2.LoadReport:
        fut: Future = Future()
        self._inbox.put(("load", fut))
        return fut.result(timeout=60)

    def post(self, *msg) -> None:
        """Messages from the network thread: ("dest", room, state, segment, incarnation, error),
        ("peer_gone", segment, incarnation)."""
        self._inbox.put(msg)

    def reserve_len(self, prompt_len: int, max_tokens: int) -> int:
        """KV slots a request needs on D: prompt + max_tokens - 1 (the last token has no KV)."""
        return min(prompt_len + max_tokens - 1, self.runner.max_context)

    def never_fits(self, prompt_len: int, max_tokens: int) -> str | None:
        need = -(-self.reserve_len(prompt_len, max_tokens) // self.ps)
        if need > self.alloc.num_pages:
            return (f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs {need} KV pages; "
                    f"the decode pool has {self.alloc.num_pages}")
        return None

    # ------------------------------------------------------------------ loop
    def _notice_pump(self) -> None:
        while not self._stop:
            try:
                for n in self.transfer.wait_notify(0.2):
                    self._inbox.put(("notice", n.sender, n.payload))
            except Exception:
                log.exception("notice pump")
                time.sleep(0.1)

    def _loop(self) -> None:
        bind_cuda_device(self.runner.device)  # this thread runs the forwards (CUDA graph replay)
        while not self._stop:
            try:
                self._drain(self._idle_wait())
                self._timeouts()
                self._prealloc()
                self._join_running()
                self._decode_step()
                self._gauges()
            except Exception:
                log.exception("decode scheduler iteration failed")
                for job in list(self._order):
                    if job.state in (JobState.WAITING, JobState.RUNNING):
                        self._fail(job, ServiceError(grpc.StatusCode.INTERNAL, "decode scheduler error"))

    def _idle_wait(self) -> float:
        if self._inflight is not None:
            return 0.0
        if any(j.state is JobState.RUNNING or j.state is JobState.WAITING for j in self._order):
            return 0.0
        if any(j.state is JobState.PREALLOC for j in self._order):
            return 0.01
        return 0.1

    def _drain(self, wait: float) -> None:
        try:
            msg = self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg) -> None:
        kind = msg[0]
        if kind == "job":
            job = msg[1]
            if job.room in self._jobs or job.room in self._quarantine:
                job.out.put(ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"room {job.room} is in use"))
                if job.room not in self._jobs:
                    self._forget(job)
            else:
                self._jobs[job.room] = job
                self._order.append(job)
        elif kind == "abort":
            _, room, rid, reason, fut = msg
            found = self._abort(room, rid, reason)
            if fut is not None:
                fut.set_result(found)
        elif kind == "load":
            if self._inflight is not None:  # report settled accounting: no step half done
                self._complete(self._take_inflight())
            msg[1].set_result(self._load_report())
        elif kind == "notice":
            self._on_notice(msg[1], msg[2])
        elif kind == "dest":
            self._on_dest_result(*msg[1:])
        elif kind == "peer_gone":
            self._on_peer_gone(msg[1], msg[2])

    # ------------------------------------------------------------------ pre-allocation
    def _prealloc(self) -> None:
        for job in list(self._order):
            if job.state is not JobState.PREALLOC:
                continue
            if not self._try_prealloc(job):
                return  # FIFO: the head waits for room

    def _try_prealloc(self, job: DecodeJob) -> bool:
        n = len(job.ids)
        if self.r2t.num_free == 0:
            return False
        if self.cache is not None:
            slots, node = self.cache.match_prefix(job.ids)  # full pages of the prompt only
            self.cache.inc_lock_ref(node)
        else:
            slots, node = torch.empty(0, dtype=torch.int64), None
        pre = slots.numel()
        cap = self.reserve_len(n, job.params.max_tokens)
        need = -(-cap // self.ps) - pre // self.ps
        if self.alloc.num_free < need and self.cache is not None:
            M.DECODE_EVICTED_PAGES.inc(self.cache.evict(need - self.alloc.num_free))
        pages = self.alloc.alloc(need)
        if pages is None:
            if node is not None:
                self.cache.dec_lock_ref(node)
            return False
        row = self.r2t.alloc()
        pg = torch.tensor(pages, dtype=torch.int64)
        delta = (pg[:, None] * self.ps + torch.arange(self.ps)[None, :]).reshape(-1)[: cap - pre]
        self.r2t.write(row, 0, slots)        # [prefix_locs (0..pre_len) |
        self.r2t.write(row, pre, delta)      #  delta_locs (pre_len..)]
        job.row, job.node, job.pre_len, job.tree_len, job.own = row, node, pre, pre, pages
        job.alloc_len = cap
        job.dst_pages = pages[: -(-n // self.ps) - pre // self.ps]
        job.state = JobState.TRANSFER
        job.t_prealloc = time.monotonic()
        job.dest_state = "sending"
        log.debug("prealloc room=%d len=%d pre_len=%d dst=%s", job.room, n, pre, job.dst_pages)
        M.DECODE_PROMPT_TOKENS.inc(n)
        M.DECODE_PREFIX_HIT_TOKENS.inc(pre)
        dest = prefill_pb2.KVDestination(room=job.room, decode_segment=self.segment_name,
                                         dst_page_ids=job.dst_pages, pre_len=pre, prompt_len=n,
                                         want_checksums=self.checksums,
                                         decode_worker_id=self.segment_name)
        self.net.set_destination(job.prefill_address, dest, job.request_id)
        return True

    def _on_dest_result(self, room: int, state: str, segment: str, incarnation: str, error: str) -> None:
        """SetDestination finished: state accepted | rejected (P holds nothing) | unknown."""
        job = self._jobs.get(room)
        q = self._quarantine.get(room)
        log.debug("destination room=%d %s %s", room, state, error)
        if job is not None and job.state is JobState.TRANSFER:
            job.dest_state = state
            job.prefill_segment, job.prefill_incarnation = segment, incarnation
            if state != "accepted":
                code = grpc.StatusCode.UNAVAILABLE if state == "unknown" else grpc.StatusCode.ABORTED
                self._fail(job, ServiceError(code, f"prefill did not take the KV destination: {error}"))
            elif job.aborted:
                self.net.abort(job.prefill_address, room, job.request_id, job.aborted)
        elif q is not None:
            if segment:
                q.prefill_segment, q.prefill_incarnation = segment, incarnation
            if state == "rejected":
                self._release_quarantine(room)
            elif state == "accepted":
                self.net.abort(q.prefill_address, room, "", "decode request ended")

    # ------------------------------------------------------------------ commit
    def _on_notice(self, sender: str, payload: bytes) -> None:
        try:
            notice = prefill_pb2.KVNotice.FromString(payload)
        except Exception:
            log.warning("undecodable notice from %s (%d bytes)", sender, len(payload))
            return
        room = int(notice.room)
        log.debug("notice room=%d ok=%s pages=%d from %s", room, notice.ok, notice.pages_sent, sender)
        if room in self._quarantine:
            self._release_quarantine(room)
            return
        job = self._jobs.get(room)
        if job is None or job.state is not JobState.TRANSFER:
            log.info("notice for unknown room %d from %s ignored", room, sender)
            return
        job.dest_state = "answered"
        if not notice.ok:
            self._fail(job, ServiceError(grpc.StatusCode.UNAVAILABLE, f"prefill failed: {notice.error}"))
            return
        n = len(job.ids)
        loc = prebuilt_out_cache_loc(self.r2t.req_to_token, job.row, job.pre_len, n - job.pre_len)
        pages = delta_pages(loc, self.ps)
        if notice.pages_sent != len(pages):
            self._fail(job, ServiceError(grpc.StatusCode.DATA_LOSS,
                                         f"prefill sent {notice.pages_sent} pages, {len(pages)} expected"))
            return
        if self.checksums:
            got = page_checksums(self.runner.kv_pool, pages)
            if list(notice.page_checksums) != got:
                self._fail(job, ServiceError(grpc.StatusCode.DATA_LOSS,
                                             f"KV checksum mismatch on room {room}"))
                return
        M.DECODE_KV_WAIT_SECONDS.observe(time.monotonic() - job.t_prealloc)
        job.cached_tokens = int(notice.cached_tokens)
        job.pages_transferred = len(pages)
        job.bytes_transferred = len(pages) * self.runner.kv_pool.page_bytes * 2 * self.runner.kv_pool.num_layers
        job.kv_len = n
        self._insert_prompt(job)
        if not job.params.greedy:
            job.generator = make_generator(job.params.seed, self.runner.device)
            if notice.sampler_state:
                job.generator.set_state(torch.frombuffer(bytearray(notice.sampler_state), dtype=torch.uint8))
        tok = int(notice.first_token_id)
        lp = notice.first_logprob
        self._emit(job, tok, lp if (job.params.logprobs or job.params.top_logprobs) else None, first=True)
        if job.state is not JobState.DONE:
            job.state = JobState.WAITING

    def _insert_prompt(self, job: DecodeJob) -> None:
        """Cache the prompt's full pages (``cache_unfinished_req``): the tree takes our new pages,
        duplicates are freed and the row points at the tree's pages; the lock moves down."""
        if self.cache is None:
            return
        full = len(job.ids) // self.ps * self.ps
        if full <= job.tree_len:
            return
        slots = self.r2t.req_to_token[job.row, :full].clone()
        n_dup = self.cache.insert(job.ids[:full], slots)
        first = job.tree_len // self.ps
        dup = [p for i, p in enumerate(job.own, start=first) if i < n_dup // self.ps]
        if dup:
            self.alloc.free(dup)
        new_slots, node = self.cache.match_prefix(job.ids[:full])
        self.cache.inc_lock_ref(node)
        self.cache.dec_lock_ref(job.node)
        job.node = node
        self.r2t.write(job.row, 0, new_slots)
        job.own = job.own[full // self.ps - first:]
        job.tree_len = full

    # ------------------------------------------------------------------ decode
    def _join_running(self) -> None:
        running = sum(j.state is JobState.RUNNING for j in self._order)
        for job in self._order:
            if job.state is JobState.WAITING and running < self.max_running:
                job.state = JobState.RUNNING
                running += 1

    def _decode_step(self) -> None:
        jobs = [j for j in self._order if j.state is JobState.RUNNING]
        if self.overlap_schedule and all(self._overlappable(j) for j in jobs):
            self._overlap_step(jobs)
            return
        if self._inflight is not None:  # a batch that cannot overlap: finish the step in flight first
            self._complete(self._take_inflight())
            jobs = [j for j in self._order if j.state is JobState.RUNNING]
        if not jobs:
            return
        # one host->device copy, slots gathered on the device: row [prefix | delta | reserved decode slots]
        batch = ForwardBatch.decode([j.row for j in jobs], [j.kv_len for j in jobs],
                                    [j.output_ids[-1] for j in jobs], self.r2t.req_to_token)
        logits = self.runner.forward(batch)
        out = sample(logits, [j.params for j in jobs], [j.generator for j in jobs],
                     [j.ids for j in jobs], [j.output_ids for j in jobs])
        M.DECODE_GENERATED_TOKENS.inc(len(jobs))
        for k, job in enumerate(jobs):
            job.kv_len += 1
            lp = None
            if job.params.logprobs or job.params.top_logprobs:
                lp = token_logprob(out.token_ids[k], out.logprobs[k], out.top_logprobs[k])
            self._emit(job, out.token_ids[k], lp)

    @staticmethod
    def _overlappable(job: DecodeJob) -> bool:
        p = job.params
        return p.greedy and not p.has_penalties and not p.logprobs and not p.top_logprobs

    def _overlap_step(self, jobs: list[DecodeJob]) -> None:
        """Launch the next step, then stream the previous one's tokens while the device computes.

        A request whose token is in flight feeds it to the next step straight from the device. One
        whose in-flight token is its last by length is not launched again; one that stops on that
        token (EOS, stop string) was launched once more: that extra token is dropped, and its pages
        are freed only after the step that writes their last slot has completed (``_free_after_step``).
        """
        prev = self._take_inflight()
        in_prev = prev.pos if prev is not None else {}  # id(job) -> index of its token in flight
        launch = []
        for j in jobs:
            if id(j) in in_prev:
                n_out = len(j.output_ids) + 1  # the in-flight token included
                if n_out >= j.params.max_tokens or len(j.ids) + n_out >= self.runner.max_context:
                    continue
            launch.append(j)
        if launch:
            dev = self.runner.device
            last = [0 if id(j) in in_prev else j.output_ids[-1] for j in launch]
            batch = ForwardBatch.decode([j.row for j in launch], [j.kv_len for j in launch], last,
                                        self.r2t.req_to_token)
            fed = [(k, in_prev[id(j)]) for k, j in enumerate(launch) if id(j) in in_prev]
            if fed:
                idx = torch.tensor(fed, dtype=torch.int64).to(dev, non_blocking=True)
                batch.input_ids[idx[:, 0]] = prev.tokens_dev[idx[:, 1]]
            logits = self.runner.forward(batch)
            tokens_dev = logits.argmax(-1)
            on_cuda = dev.type == "cuda"
            host = torch.empty(len(launch), dtype=torch.int64, pin_memory=on_cuda)
            host.copy_(tokens_dev, non_blocking=on_cuda)
            copied = None
            if on_cuda:
                copied = torch.cuda.Event()
                copied.record()
            for j in launch:
                j.kv_len += 1
            self._inflight = InFlight(launch, tokens_dev, host, copied,
                                      {id(j): k for k, j in enumerate(launch)})
        if prev is not None:
            self._complete(prev)

    def _take_inflight(self) -> InFlight | None:
        step, self._inflight = self._inflight, None
        return step

    def _complete(self, step: InFlight) -> None:
        """Read a launched step's tokens (waits for that step only) and stream them; then free the
        requests that ended while a step wrote into their slots, once no step in flight does."""
        if step.copied is not None:
            step.copied.synchronize()
        toks = step.tokens_host.tolist()
        live = [(job, tok) for job, tok in zip(step.jobs, toks) if job.state is JobState.RUNNING]
        M.DECODE_GENERATED_TOKENS.inc(len(live))  # the others were aborted or failed in flight
        for job, tok in live:  # emitting one job's token never ends another job
            self._emit(job, tok, None)
        busy = self._inflight.pos if self._inflight is not None else {}
        keep = []
        for job, quarantine in self._free_after_step:
            if id(job) in busy:
                keep.append((job, quarantine))
            else:
                self._free(job, quarantine)
        self._free_after_step = keep

    def _emit(self, job: DecodeJob, tok: int, lp, first: bool = False) -> None:
        """Append a token, decide whether the request finished, stream the chunk."""
        job.output_ids.append(tok)
        p = job.params
        reason, matched = "", ""
        if job.detok is not None:
            job.detok.add(tok)
            if job.detok.stopped:
                reason, matched = "stop", job.detok.stop_reason or ""
        if not reason:
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos):
                reason = "stop"
            elif len(job.output_ids) >= p.max_tokens or len(job.ids) + len(job.output_ids) >= self.runner.max_context:
                reason = "length"
        chunk = decode_pb2.DecodeChunk(token_ids=[tok], finish_reason=reason, matched_stop=matched)
        if lp is not None:
            chunk.logprobs.append(lp)
        if first or reason:
            self._fill_summary(job, chunk)
        job.out.put(chunk)
        if reason:
            job.finish_reason = reason
            self._finish(job)

    def _fill_summary(self, job: DecodeJob, chunk) -> None:
        chunk.prompt_tokens = len(job.ids)
        chunk.cached_tokens = job.cached_tokens
        chunk.decode_prefix_tokens = job.pre_len
        chunk.kv_pages_transferred = job.pages_transferred
        chunk.kv_bytes_transferred = job.bytes_transferred
        chunk.completion_tokens = len(job.output_ids)

    # ------------------------------------------------------------------ endings
    def _finish(self, job: DecodeJob) -> None:
        """Normal end: KV delivered and committed; release everything, end the stream."""
        self._release(job, quarantine=False)
        job.out.put(None)

    def _fail(self, job: DecodeJob, err: ServiceError) -> None:
        if job.state is JobState.DONE:
            return
        may_write = job.state is JobState.TRANSFER and job.dest_state in ("sending", "accepted", "unknown")
        if may_write and job.dest_state == "accepted":
            self.net.abort(job.prefill_address, job.room, job.request_id, str(err))
        self._release(job, quarantine=may_write)
        job.out.put(err)

    def _abort(self, room: int, request_id: str, reason: str) -> bool:
        job = self._jobs.get(room) if room else next(
            (j for j in self._order if j.request_id == request_id), None)
        if job is None:
            return False
        job.aborted = reason or "aborted"
        self._fail(job, ServiceError(grpc.StatusCode.CANCELLED, f"aborted: {job.aborted}"))
        return True

    def _release(self, job: DecodeJob, quarantine: bool) -> None:
        """The job is over: forget it now; free its row and pages now, or after the decode step in
        flight when that step writes one of its slots (overlap schedule)."""
        if self._inflight is not None and id(job) in self._inflight.pos and job.row is not None:
            self._free_after_step.append((job, quarantine))
        else:
            self._free(job, quarantine)
        job.state = JobState.DONE
        self._forget(job)
        self._jobs.pop(job.room, None)
        if job in self._order:
            self._order.remove(job)

    def _free(self, job: DecodeJob, quarantine: bool) -> None:
        if job.row is not None:
            ps = self.ps
            held = job.own
            if quarantine and job.dst_pages:
                qset = set(job.dst_pages)
                self._quarantine[job.room] = Quarantined(job.room, list(job.dst_pages),
                                                         job.prefill_address,
                                                         job.prefill_segment or job.prefill_worker_id,
                                                         job.prefill_incarnation)
                held = [p for p in job.own if p not in qset]
            first = job.tree_len // ps
            if self.cache is not None and not quarantine and job.kv_len // ps * ps > job.tree_len:
                kept = self.cache.insert_finished((job.ids + job.output_ids)[:job.kv_len],
                                                  self.r2t.req_to_token[job.row], first)
                held = [p for i, p in enumerate(job.own, start=first) if i not in kept]
            if held:
                self.alloc.free(held)
            job.own = []
            if job.node is not None:
                self.cache.dec_lock_ref(job.node)
                job.node = None
            self.r2t.free(job.row)
            job.row = None

    def _forget(self, job: DecodeJob) -> None:
        with self._known_lock:
            self._known.discard(job.room)
            if self._rids.get(job.request_id) == job.room:
                del self._rids[job.request_id]

    def _release_quarantine(self, room: int) -> None:
        q = self._quarantine.pop(room, None)
        if q is not None and q.pages:
            self.alloc.free(q.pages)

    def _on_peer_gone(self, segment: str, incarnation: str) -> None:
        for job in list(self._order):
            if job.state is JobState.TRANSFER and job.prefill_segment == segment \
                    and (not incarnation or job.prefill_incarnation == incarnation):
                job.dest_state = "peer_gone"
                self._fail(job, ServiceError(grpc.StatusCode.UNAVAILABLE,
                                             f"prefill worker {segment} is gone"))
        for room, q in list(self._quarantine.items()):
            if q.prefill_segment == segment and (not incarnation or q.prefill_incarnation == incarnation):
                self._release_quarantine(room)

    def _timeouts(self) -> None:
        now = time.monotonic()
        for job in list(self._order):
            if job.state is JobState.TRANSFER and now - job.t_prealloc > self.kv_wait_timeout_s:
                self._fail(job, ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                             f"no KV from prefill within {self.kv_wait_timeout_s:g} s"))
        for room, q in list(self._quarantine.items()):
            if now - q.since > self.fence_timeout_s:
                log.warning("room %d: no notice from %s after %.0f s; releasing %d quarantined pages",
                            room, q.prefill_segment or q.prefill_address, now - q.since, len(q.pages))
                self._release_quarantine(room)
        if now - self._last_liveness > self.liveness_interval_s:
            self._last_liveness = now
            peers = {(j.prefill_segment, j.prefill_incarnation) for j in self._order
                     if j.state is JobState.TRANSFER and j.prefill_segment}
            peers |= {(q.prefill_segment, q.prefill_incarnation) for q in self._quarantine.values()
                      if q.prefill_segment}
            if peers:
                self.net.check_alive(peers)

    # ------------------------------------------------------------------ accounting
    def _owned(self) -> int:
        return (sum(len(j.own) for j in self._order) + sum(len(q.pages) for q in self._quarantine.values())
                + sum(len(j.own) for j, _ in self._free_after_step))

    def _load_report(self) -> common_pb2.LoadReport:
        if self.cache is not None:
            st = self.cache.stats()
            evictable, locked, min_ref = st.evictable_pages, st.protected_pages, st.min_lock_ref
        else:
            evictable = locked = min_ref = 0
        total = self.alloc.num_pages
        acc = common_pb2.KVAccounting(
            total_pages=total, free_pages=self.alloc.num_free, evictable_pages=evictable,
            locked_pages=locked, owned_pages=self._owned(), min_lock_ref=min_ref,
            held_rooms=len(self._jobs) + len(self._quarantine), held_req_slots=self.r2t.num_used)
        return common_pb2.LoadReport(
            waiting_requests=sum(j.state is JobState.PREALLOC for j in self._order),
            running_requests=sum(j.state in (JobState.RUNNING, JobState.WAITING) for j in self._order),
            transferring_requests=sum(j.state is JobState.TRANSFER for j in self._order),
            kv_usage=1.0 - self.alloc.num_free / total, accounting=acc)

    def _gauges(self) -> None:
        c = {s: 0 for s in JobState}
        for j in self._order:
            c[j.state] += 1
        M.DECODE_QUEUE.labels(queue="prealloc").set(c[JobState.PREALLOC])
        M.DECODE_QUEUE.labels(queue="transfer").set(c[JobState.TRANSFER])
        M.DECODE_QUEUE.labels(queue="waiting").set(c[JobState.WAITING])
        M.DECODE_RUNNING.set(c[JobState.RUNNING])
        total = self.alloc.num_pages
        ev = self.cache.evictable_size() if self.cache else 0
        lk = self.cache.protected_size() if self.cache else 0
        # evictable radix pages are reclaimable, so they don't count as used (SGLang's convention)
        M.DECODE_KV_USAGE.set(1.0 - (self.alloc.num_free + ev) / total)
        M.DECODE_KV_PAGES.labels(state="free").set(self.alloc.num_free)
        M.DECODE_KV_PAGES.labels(state="evictable").set(ev)
        M.DECODE_KV_PAGES.labels(state="locked").set(lk)
        M.DECODE_KV_PAGES.labels(state="owned").set(self._owned())
