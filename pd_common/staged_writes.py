"""One P rank's part of a rank batch: its writes' puts on its own transfer engine, one block per
page (``pd_common.head_slices``), gathering through a bounded staging area where the rank sends only
some of its heads.

* A write of all of the rank's heads is submitted at once from the caller's thread: its source is
  the pool's pages themselves.
* A write of some of them (P TP=1 -> D TP=2, ...) goes to the rank's *stager* thread, which copies
  chunks of the pages' heads into the staging area (``index_select`` into a ``[pages, layers, 2,
  page_size, heads, head_dim]`` view), submits one put per page from there, and reuses the area's
  two halves in turn: chunk k + 1 is gathered while chunk k's puts fly, and a half is refilled only
  after the batch that read it is terminal. Jobs run in arrival order, so at most the area is held.

The staging area is one buffer of ``staging_bytes`` on the pool's device, allocated and registered
with the engine on the first staged write and kept (a pre-registered pool: registering per batch
costs a UCX memory map per batch, and on CUDA an IPC handle; ``bench/tp_transfer.py`` reports
the one-off registration time). ``StagingArea.in_use`` is what unfinished chunks hold; every path
(completion, a failed put, a gather that raised) returns it to zero.

Reading P's pages from another thread is safe for the same reason UCX may read them
asynchronously: the forwards that computed them were done (on CUDA: synchronised) before the job
started, and P frees no page while a batch reading it is pending.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pd_common.head_slices import BlockWrite, PageShape, RankWrite, block_descriptors, block_write, check_pages
from transfer_svc.rank_regions import RankRegion
from transfer_svc.types import BatchStatus, State

log = logging.getLogger("halfmoon.worker.tp")

DEFAULT_STAGING_MB = 64


class StagingArea:
    """A registered buffer of ``nbytes`` on ``like``'s device and dtype, in two halves, allocated
    on first use. ``in_use``: bytes of chunks whose puts are not yet terminal; ``peak``: the most.

    Raises (``half``): ValueError when the area is smaller than two elements.
    """

    def __init__(self, engine, like: torch.Tensor, nbytes: int):
        self.engine, self.like, self.nbytes = engine, like, int(nbytes)
        self._buf: torch.Tensor | None = None
        self.register_s = 0.0
        self._held = [0, 0]
        self._lock = threading.Lock()
        self.peak = 0

    @property
    def half_bytes(self) -> int:
        item = self.like.element_size()
        return (self.nbytes // item // 2) * item

    def half(self, k: int) -> torch.Tensor:
        """Half ``k`` (0 or 1) as a flat tensor of the pool's dtype (allocated and registered once)."""
        if self._buf is None:
            n = self.nbytes // self.like.element_size() // 2
            if n < 1:
                raise ValueError(f"staging area of {self.nbytes} bytes is too small")
            t0 = time.monotonic()
            buf = torch.empty(2 * n, dtype=self.like.dtype, device=self.like.device)
            loc = "cpu" if buf.device.type == "cpu" else f"cuda:{buf.device.index or 0}"
            self.engine.register_memory(buf.data_ptr(), buf.numel() * buf.element_size(), loc)
            self.register_s = time.monotonic() - t0
            self._buf = buf
            log.info("KV staging area: %d MiB registered in %.1f ms", self.nbytes >> 20, 1e3 * self.register_s)
        n = self._buf.numel() // 2
        return self._buf[k * n:(k + 1) * n]

    def hold(self, k: int, nbytes: int) -> None:
        with self._lock:
            self._held[k] = nbytes
            self.peak = max(self.peak, sum(self._held))

    def free(self, k: int) -> None:
        with self._lock:
            self._held[k] = 0

    @property
    def in_use(self) -> int:
        with self._lock:
            return sum(self._held)


@dataclass
class Target:
    """One write of this rank: into D rank ``dst`` (its region) through the opened ``segment``."""

    segment: object
    dst: RankRegion
    write: RankWrite


@dataclass
class _Job:
    bids: list[int] = field(default_factory=list)  # direct writes' engine batches
    staged: Future | None = None                    # -> "" or why the staged writes failed
    error: str = ""                                 # a direct submit that raised
    puts: int = 0
    nbytes: int = 0


class RankWrites:
    """This rank's writes of rank batches (module docstring).

    Args:
        engine: this rank's transfer engine (its pool registered). region: its page_major pool
            ``[pages, layers, 2, page_size, heads, head_dim]``. me: its region as peers see it.
        shape: the page shape. staging_bytes: the staging area's size (at least two pages of this
            rank's heads; ``prefill --kv-staging-mb``), capped at the rank's pool size.
    Raises:
        ValueError: ``staging_bytes`` below two pages of this rank's heads.
    """

    def __init__(self, engine, region: torch.Tensor, me: RankRegion, shape: PageShape, staging_bytes: int):
        if staging_bytes < 2 * shape.stride(me.heads):
            raise ValueError(f"staging area of {staging_bytes} bytes is below two pages of "
                             f"{shape.stride(me.heads)} bytes")
        self.engine, self.region, self.me, self.shape = engine, region, me, shape
        # a gather never holds more than the rank's whole pool: a larger area (--kv-staging-mb 1e9)
        # would only fail to allocate at the first staged write, failing every such request
        pool_bytes = region.numel() * region.element_size()
        staging_bytes = min(int(staging_bytes), max(pool_bytes, 2 * shape.stride(me.heads)))
        self.staging = StagingArea(engine, region, staging_bytes)
        self._ids = itertools.count(1)
        self._jobs: dict[int, _Job] = {}
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="kv-stager")

    def start(self, targets: Sequence[Target], src_pages: Sequence[int], dst_pages: Sequence[int],
              not_after: float | None) -> int:
        """Start every target's puts of ``src_pages[i]`` -> ``dst_pages[i]`` -> job id. A submit that
        fails makes the job FAILED (it still needs ``release``).

        Raises:
            ValueError: a head range or page is out of its region, or the page lists differ in
                length (nothing was submitted).
        """
        src_pages, dst_pages = [int(p) for p in src_pages], [int(p) for p in dst_pages]
        direct, staged = [], []
        job = _Job()
        for t in targets:  # every descriptor is built (and checked) before anything is submitted
            bw = block_write(t.write, self.me, t.dst, self.shape)
            if bw.staged:
                if len(src_pages) != len(dst_pages):
                    raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
                check_pages(src_pages, self.me, self.shape)
                check_pages(dst_pages, t.dst, self.shape)
                staged.append((t, bw))
            else:
                direct.append((t, block_descriptors(bw, self.me, t.dst, self.shape, src_pages, dst_pages)))
            job.puts += len(src_pages)
            job.nbytes += len(src_pages) * bw.block_bytes
        jid = next(self._ids)
        self._jobs[jid] = job
        try:
            for t, descs in direct:
                job.bids.append(self.engine.submit(t.segment, descs, not_after=not_after))
        except Exception as e:  # SegmentClosed, BoundsError: the staged writes do not start either
            job.error = f"rank {self.me.rank}: KV write not queued: {e}"
            return jid
        if staged:
            job.staged = self._stager.submit(self._run_staged, staged, src_pages, dst_pages, not_after)
        return jid

    def _run_staged(self, staged: list[tuple[Target, BlockWrite]], src_pages: list[int],
                    dst_pages: list[int], not_after: float | None) -> str:
        errors: list[str] = []
        inflight: list[int | None] = [None, None]  # engine batch reading each half
        k = 0

        def finish(h: int) -> None:
            bid, inflight[h] = inflight[h], None
            if bid is not None:
                st = self.engine.wait(bid)
                self.engine.release(bid)
                if st.state is not State.COMPLETED:
                    errors.append(f"rank {self.me.rank}: {st.reason or st.state.name}")
            self.staging.free(h)

        try:
            src_idx = torch.tensor(src_pages, dtype=torch.int64, device=self.region.device)
            for t, bw in staged:
                lo = bw.src_head_offset
                heads = slice(lo, lo + bw.write.head_end - bw.write.head_start)
                per = self.staging.half_bytes // bw.block_bytes
                for i in range(0, len(src_pages), per):
                    h, k = k % 2, k + 1
                    finish(h)
                    if errors:
                        return "; ".join(errors)
                    m = min(per, len(src_pages) - i)
                    _, layers, two, ps, _, hd = self.region.shape
                    out = self.staging.half(h)[:m * bw.block_bytes // self.region.element_size()].view(
                        m, layers, two, ps, heads.stop - heads.start, hd)
                    self.staging.hold(h, m * bw.block_bytes)
                    torch.index_select(self.region[:, :, :, :, heads], 0, src_idx[i:i + m], out=out)
                    if out.device.type == "cuda":  # the gather lands before UCX reads the staging
                        torch.cuda.current_stream(out.device).synchronize()
                    descs = block_descriptors(bw, self.me, t.dst, self.shape, src_pages[i:i + m],
                                              dst_pages[i:i + m], staging_addr=out.data_ptr())
                    inflight[h] = self.engine.submit(t.segment, descs, not_after=not_after)
        except Exception as e:  # a submit or gather that raised: what was posted is still waited for
            errors.append(f"rank {self.me.rank}: staged KV write failed: {e}")
        finally:
            for h in (0, 1):
                finish(h)
        return "; ".join(errors)

    def status(self, jid: int) -> BatchStatus:
        """PENDING while any of the job's puts may still read this rank's pages or write D's; then
        COMPLETED, or FAILED with every reason."""
        job = self._jobs[jid]
        reasons = [job.error] if job.error else []
        pending = False
        for bid in job.bids:
            st = self.engine.status(bid)
            pending |= st.state is State.PENDING
            if st.state is State.FAILED:
                reasons.append(f"rank {self.me.rank}: {st.reason}")
        if job.staged is not None:
            if not job.staged.done():
                pending = True
            elif job.staged.exception() is not None:  # waiting for a batch raised: it says why
                reasons.append(f"rank {self.me.rank}: staged KV write failed: {job.staged.exception()}")
            elif job.staged.result():
                reasons.append(job.staged.result())
        if pending:
            return BatchStatus(State.PENDING, 0, job.nbytes)
        if reasons:
            return BatchStatus(State.FAILED, 0, job.nbytes, "; ".join(reasons))
        return BatchStatus(State.COMPLETED, job.nbytes, job.nbytes)

    def wait(self, jid: int) -> BatchStatus:
        """Block until the job is terminal (each batch's own deadline bounds it)."""
        job = self._jobs[jid]
        for bid in job.bids:
            self.engine.wait(bid)
        if job.staged is not None:
            job.staged.exception()  # waits; status() reports what it raised
        return self.status(jid)

    def puts(self, jid: int) -> tuple[int, int]:
        """(descriptors, bytes) the job moves: one descriptor per page per write."""
        job = self._jobs[jid]
        return job.puts, job.nbytes

    def release(self, jid: int) -> None:
        """Forget a terminal job."""
        job = self._jobs.pop(jid, None)
        if job is not None:
            for bid in job.bids:
                self.engine.release(bid)

    def close(self) -> None:
        self._stager.shutdown(wait=False, cancel_futures=True)
