"""Requests whose destination went to P, waiting for the delta's KV and P's notice.

On P's notice the delta is checked and committed, all over the delta's slots ``out_cache_loc =
req_to_token[row, pre_len:prompt_len]`` (the slots P filled; never ``row[:n]``, which are the
prefix's when D had a hit): the notice's page count; then, under tensor parallelism, the pages P
wrote head-blocked are rewritten token-major on every rank (``pd_common.head_blocks``); then (with
``--kv-checksums``) its per-(page, kv head) checksums against every rank's heads of the same pages
(rank 0's own, each follower's over the TP command pipe: ``pd_common.rank_checksums``); then the
prompt's full pages go into D's radix cache and the request moves on with P's first token. The
checksums are verified last, after every step that puts the delta's bytes in their final place
(the unblock), so the followers' queries travel behind any command such a step sent them. This
queue also follows SetDestination outcomes, fails requests whose KV does not come in time, and
polls the liveness of the prefill workers that may still write D's pages.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
import torch

from decode_svc.jobs import DecodeJob, DestState, JobState
from decode_svc.messages import DestResult, Notice, PeerGone, PrefillNet
from decode_svc.prebuilt import delta_pages, prebuilt_out_cache_loc
from decode_svc.quarantine import Quarantine
from engine.distributed.group import TPRankDied
from engine.kvcache.cache_manager import CacheManager
from engine.sampler import make_generator
from pd_common.head_blocks import HeadUnblocker
from pd_common.head_checksums import mismatches
from pd_common.protocol import ServiceError
from pd_common.rank_checksums import every_rank_sums
from protos import common_pb2, prefill_pb2
from telemetry import metrics as M

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

log = logging.getLogger("halfmoon.decode")

# (job, P's first token id, its TokenLogprob when the request asked for logprobs, else None)
Committed = tuple[DecodeJob, int, common_pb2.TokenLogprob | None]


class KVWaitQueue:
    """TRANSFER jobs by room (scheduler thread only).

    Args:
        runner: D's ModelRunner (its KV pool for checksums and byte counts, its device for samplers).
        kv: D's CacheManager (commit of the prompt's pages).
        net: toward prefill workers (abort, liveness).
        quarantine: rooms whose pages P may still write (their notices and results are its own).
        fail: ends a job with an error (the scheduler's, which also quarantines and aborts on P).
        checksums: verify ``KVNotice.head_checksums`` over the destination pages, every rank's heads.
        timeout_s: a request waiting for KV this long fails with DEADLINE_EXCEEDED.
        liveness_interval_s: seconds between liveness checks of the prefill workers.
    """

    def __init__(self, runner: ModelRunner, kv: CacheManager, net: PrefillNet, quarantine: Quarantine,
                 fail: Callable[[DecodeJob, ServiceError], None], *, checksums: bool, timeout_s: float,
                 liveness_interval_s: float):
        self.runner = runner
        self.kv = kv
        self.net = net
        self.quarantine = quarantine
        self._fail = fail
        self.checksums = checksums
        self.timeout_s = timeout_s
        self.liveness_interval_s = liveness_interval_s
        self.unblocker = HeadUnblocker.for_runner(runner)
        self._jobs: dict[int, DecodeJob] = {}  # insertion order = arrival order (prealloc is FIFO)
        self._last_liveness = 0.0

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job: DecodeJob) -> None:
        job.state = JobState.TRANSFER
        self._jobs[job.room] = job

    def discard(self, job: DecodeJob) -> None:
        self._jobs.pop(job.room, None)

    # ------------------------------------------------------------------ messages
    def on_dest_result(self, msg: DestResult) -> None:
        log.debug("destination room=%d %s %s", msg.room, msg.state.value, msg.error)
        job = self._jobs.get(msg.room)
        if job is None:
            self.quarantine.on_dest_result(msg)
            return
        job.dest_state = msg.state
        job.prefill_segment, job.prefill_incarnation = msg.segment, msg.incarnation
        job.prefill_process = msg.process
        if msg.state is not DestState.ACCEPTED:
            code = grpc.StatusCode.UNAVAILABLE if msg.state is DestState.UNKNOWN else grpc.StatusCode.ABORTED
            self._fail(job, ServiceError(code, f"prefill did not take the KV destination: {msg.error}"))
        elif job.aborted:
            self.net.abort(job.prefill_address, msg.room, job.request_id, job.aborted)

    def on_peer_gone(self, msg: PeerGone) -> None:
        """Fail the requests waiting on that P (the router retries elsewhere); only a proven death
        frees their pages at once, otherwise they go to the quarantine."""
        for job in list(self._jobs.values()):
            if msg.matches(job.prefill_segment, job.prefill_incarnation):
                if msg.proven:
                    job.dest_state = DestState.PEER_GONE
                self._fail(job, ServiceError(grpc.StatusCode.UNAVAILABLE,
                                             f"prefill worker {msg.segment} is gone ({msg.cause})"))
        self.quarantine.on_peer_gone(msg)

    def on_notice(self, msg: Notice) -> Committed | None:
        """Check and commit the room's delta; returns the job ready for the decode batch, or None
        (failed, quarantined room released, or nothing to do). The job stays in this queue until
        the caller ``discard``s it, once the batch took it."""
        try:
            notice = prefill_pb2.KVNotice.FromString(msg.payload)
        except Exception:
            log.warning("undecodable notice from %s (%d bytes)", msg.sender, len(msg.payload))
            return None
        room = int(notice.room)
        log.debug("notice room=%d ok=%s pages=%d from %s", room, notice.ok, notice.pages_sent, msg.sender)
        if self.quarantine.release(room, "notice"):
            return None
        job = self._jobs.get(room)
        if job is None:
            log.info("notice for unknown room %d from %s ignored", room, msg.sender)
            return None
        job.dest_state = DestState.ANSWERED
        if not notice.ok:
            self._fail(job, ServiceError(grpc.StatusCode.UNAVAILABLE, f"prefill failed: {notice.error}"))
            return None
        error = self._check_delta(job, notice)
        if not error and len(notice.samples) != job.n - 1:
            error = f"prefill sent {len(notice.samples) + 1} first tokens, {job.n} samples expected"
        if error:
            self._fail(job, ServiceError(grpc.StatusCode.DATA_LOSS, error))
            return None
        failure = self.unblock(job, notice)  # before anything reads the pages: checksums, commit
        if failure is not None:
            self._fail(job, failure)
            return None
        if self.checksums:
            failure = self.verify_checksums(job, notice)
            if failure is not None:
                self._fail(job, failure)
                return None
        # replay P's first token into D's fresh matcher: the same grammar and token give P's state
        if job.grammar is not None and not job.grammar.accept(int(notice.first_token_id)):
            self._fail(job, ServiceError(grpc.StatusCode.INTERNAL, f"prefill's first token "
                                         f"{notice.first_token_id} is not allowed by the request's grammar"))
            return None
        self._commit(job, notice)
        wants_lp = job.params.logprobs or job.params.top_logprobs
        return job, int(notice.first_token_id), notice.first_logprob if wants_lp else None

    def _delta_pages(self, job: DecodeJob) -> list[int]:
        """The physical pages P filled: those of ``row[pre_len:prompt_len]``."""
        lease, n = job.lease, len(job.prompt_ids)
        loc = prebuilt_out_cache_loc(self.kv.r2t.req_to_token, lease.row, lease.pre_len, n - lease.pre_len)
        return delta_pages(loc, self.kv.page_size)

    def _check_delta(self, job: DecodeJob, notice: prefill_pb2.KVNotice) -> str:
        """What is wrong with the delta's size P reports ("" when nothing); records the transfer."""
        pages = self._delta_pages(job)
        if notice.pages_sent != len(pages):
            return f"prefill sent {notice.pages_sent} pages, {len(pages)} expected"
        pool = self.runner.kv_pool
        job.pages_transferred = len(pages)
        # every rank's kv heads (this pool, rank 0's under tensor parallelism, holds only its own)
        heads = self.runner.model_config.num_kv_heads
        job.bytes_transferred = len(pages) * pool.page_bytes // pool.num_kv_heads * heads * 2 * pool.num_layers
        return ""

    def unblock(self, job: DecodeJob, notice: prefill_pb2.KVNotice) -> ServiceError | None:
        """Rewrite the delta pages P wrote head-blocked (``notice.head_block_cuts``) token-major on
        every rank: rank 0 inline, followers by a command on the TP pipe (no reply needed:
        pd_common/head_blocks.py). None when done (or nothing was blocked); DATA_LOSS for malformed
        cuts (nothing changed); UNAVAILABLE when a follower's pipe is gone. Call before anything
        reads the pages: the checksum queries then travel behind the unblock commands."""
        try:
            error = self.unblocker.unblock(self._delta_pages(job), notice.head_block_cuts)
        except TPRankDied as e:
            return ServiceError(grpc.StatusCode.UNAVAILABLE, f"KV of room {job.room} not unblocked: {e}")
        if error:
            return ServiceError(grpc.StatusCode.DATA_LOSS, f"prefill's KV of room {job.room}: {error}")
        return None

    def verify_checksums(self, job: DecodeJob, notice: prefill_pb2.KVNotice) -> ServiceError | None:
        """The notice's per-(page, kv head) sums against every rank's heads of the delta pages:
        None when all match; DATA_LOSS naming the first bad (page, head) and its rank; UNAVAILABLE
        when a follower does not answer in time (naming it). Call after the delta's bytes are in
        their final place on every rank."""
        pages, heads = self._delta_pages(job), self.runner.model_config.num_kv_heads
        got = list(notice.head_checksums)
        if len(got) != len(pages) * heads:
            return ServiceError(grpc.StatusCode.DATA_LOSS,
                                f"KV checksums of room {job.room}: {len(got)} sent, {len(pages)} pages x "
                                f"{heads} kv heads expected")
        if not pages:  # a full prefix hit: nothing was sent
            return None
        try:
            ranks = every_rank_sums(self.runner, pages)
        except (TimeoutError, TPRankDied, ValueError) as e:
            return ServiceError(grpc.StatusCode.UNAVAILABLE, f"KV checksums of room {job.room} not verified: {e}")
        for r in ranks:
            bad = mismatches(got, heads, r.head_start, r.sums)
            if bad:
                i, head = bad[0]
                log.warning("KV checksum mismatch on room %d: page %d (delta page %d) kv head %d on rank %d "
                            "(%d bad sums on that rank)", job.room, pages[i], i, head, r.rank, len(bad))
                return ServiceError(grpc.StatusCode.DATA_LOSS, f"KV checksum mismatch on room {job.room}: "
                                    f"delta page {i}, kv head {head} (rank {r.rank})")
        return None

    def _commit(self, job: DecodeJob, notice: prefill_pb2.KVNotice) -> None:
        M.DECODE_KV_WAIT_SECONDS.observe(time.monotonic() - job.t_prealloc)
        job.cached_tokens = int(notice.cached_tokens)
        job.kv_len = len(job.prompt_ids)
        job.first_samples = list(notice.samples)
        self.kv.commit(job.lease, job.prompt_ids)
        if not job.params.greedy:
            job.generator = make_generator(job.params.seed, self.runner.device)
            if notice.sampler_state:
                job.generator.set_state(torch.frombuffer(bytearray(notice.sampler_state), dtype=torch.uint8))

    # ------------------------------------------------------------------ time
    def expire(self, now: float) -> None:
        """Fail the requests that waited longer than the KV-wait timeout (``now``: time.monotonic())."""
        for job in list(self._jobs.values()):
            if now - job.t_prealloc > self.timeout_s:
                self._fail(job, ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                             f"no KV from prefill within {self.timeout_s:g} s"))

    def poll_liveness(self, now: float) -> None:
        """Every ``liveness_interval_s``: ask whether the prefill workers that may still write D's
        pages (waiting requests' and quarantined rooms') are alive."""
        if now - self._last_liveness <= self.liveness_interval_s:
            return
        self._last_liveness = now
        peers = {(j.prefill_segment, j.prefill_incarnation, j.prefill_process)
                 for j in self._jobs.values() if j.prefill_segment}
        peers |= self.quarantine.peers()
        if peers:
            self.net.check_alive(peers)
