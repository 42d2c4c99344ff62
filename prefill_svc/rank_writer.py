"""P's KV writes when P or D runs tensor-parallel: one batch of pages becomes a write per
(P rank, D rank, kv-head range) (``pd_common.head_slices``), each on the writing rank's own
transfer engine, and one *rank batch* id that is COMPLETED once all of them are.

Rank 0 submits its own writes; a follower's go to it as a ``WriteCommand`` over the TP group (after
the forwards that computed the pages) and come back as a ``WriteReply``. D rank s's region is
opened as its own segment (``rank_descriptor``); D rank 0's is the destination's segment. Since
those writes travel over several endpoints, the transfer engine's notice ordering (behind earlier
batches to ONE segment) does not cover them: ``DeltaSender`` queues the notice only once every
rank batch of the job completed. With checksums asked, each rank sums the kv heads it writes
(``pd_common.head_checksums``; rank 0 at submit, a follower in its ``WriteReply``) and
``head_sums`` gives the batch's sums of every head written, each from its writer. A follower's
transfer engine counts its bytes in the follower's process, which serves no metrics:
``halfmoon_transfer_bytes_total`` gets them here, from its ``WriteReply``.

Each write moves one contiguous block per page (``pd_common.head_slices``): from the P page itself
or, where the P rank sends only some of its heads, from its registered staging area
(``pd_common.staged_writes``: gathered in chunks, bounded by ``--kv-staging-mb``); into the whole D
page or, where the D rank receives heads from several P ranks, head-blocked into D's page at the
block's offset (D rewrites those pages token-major on the notice, ``pd_common.head_blocks``; the
notice carries the cuts, ``head_cuts``). The strided per-row puts this replaced measured 40-75x
slower (bench/results/tp_transfer_cpu_table.txt).
"""

from __future__ import annotations

import itertools
import json
import queue
from collections.abc import Sequence
from dataclasses import dataclass, field

from pd_common.head_checksums import HeadSums, by_head, head_checksums
from pd_common.head_slices import PageShape, block_write, check_pages, head_cuts, plan_rank_writes
from pd_common.staged_writes import RankWrites, Target
from pd_common.tp_rank import WriteCommand, WriteReply, WriteTarget
from telemetry import metrics as M
from transfer_svc.engine import BatchStatus, DescriptorError, State
from transfer_svc.rank_regions import RankRegion, rank_descriptor, rank_regions


@dataclass(frozen=True)
class RankPages:
    """What one (P rank, D rank) write of a batch moved: pages of heads ``[head_start, head_end)``,
    as ``descriptors`` puts (one per page), gathered through P's staging (``staged``), landing
    head-blocked in D's pages (``blocked``)."""

    src_rank: int
    dst_rank: int
    head_start: int
    head_end: int
    pages: int
    descriptors: int = 0
    staged: bool = False
    blocked: bool = False


@dataclass
class _RankBatch:
    local: int | None                     # rank 0's RankWrites job
    remote: dict[int, int]                # follower rank -> command id
    nbytes: int
    writes: list[RankPages]
    failed: str = ""
    replies: dict[int, WriteReply] = field(default_factory=dict)  # follower rank -> its reply
    sums: HeadSums = field(default_factory=dict)  # rank 0's written heads (checksums asked)


class RankWriter:
    """Rank batches of P's pages into a D segment (see the module docstring).

    Args:
        transfer: rank 0's transfer engine. group: P's ``TPGroup`` (None: P runs one rank).
        regions: P's rank regions, rank order (``pd_common.tp_rank.local_region`` for rank 0, the
            followers' descriptors for the others). shape: the page shape P publishes.
        local: rank 0's own writes (``RankWrites`` over its pool and staging area).
        kv_pool: rank 0's KV pool (its heads' checksums); None: checksums cannot be asked.
    """

    def __init__(self, transfer, group, regions: Sequence[RankRegion], shape: PageShape, local: RankWrites,
                 kv_pool=None):
        self.transfer, self.group, self.regions, self.shape = transfer, group, list(regions), shape
        self.local, self.kv_pool = local, kv_pool
        self._ids = itertools.count(1)
        self._cmd_ids = itertools.count(1)
        self._batches: dict[int, _RankBatch] = {}
        self._by_cmd: dict[int, int] = {}  # command id -> rank batch id

    def per_rank(self, segment) -> bool:
        """Whether writes into ``segment`` (D's) go rank by rank: P or D runs several ranks."""
        return len(self.regions) > 1 or segment.kv_layout.tp_size > 1

    def refusal(self, segment) -> str | None:
        """Why D's kv heads cannot be mapped onto P's ranks (its descriptor's regions are malformed,
        or some D head is held by no P rank), or None."""
        try:
            plan_rank_writes(self.regions, rank_regions(segment.descriptor))
        except (ValueError, DescriptorError) as e:
            return f"decode's KV shards cannot be written from this prefill worker's: {e}"
        return None

    def head_cuts(self, segment) -> list[int]:
        """The notice's ``head_block_cuts`` for writes into ``segment``: the plan's kv-head
        boundaries when some D rank receives head-blocked pages, else empty."""
        dst = rank_regions(segment.descriptor)
        plan = plan_rank_writes(self.regions, dst)
        if all((w.head_start, w.head_end) == (dst[w.dst_rank].head_start, dst[w.dst_rank].head_end) for w in plan):
            return []
        return head_cuts(plan)

    def submit(self, segment, src_pages: Sequence[int], dst_pages: Sequence[int],
               not_after: float | None, checksums: bool = False) -> tuple[int, int, list[RankPages]]:
        """Write ``src_pages[i]`` of every P rank into ``dst_pages[i]`` of D's ranks -> (rank batch
        id, bytes, what each rank pair moves). Call from the thread that runs P's forwards.
        ``checksums``: every writing rank sums the heads it writes (``head_sums``).

        Raises:
            ValueError / DescriptorError: D's kv heads cannot be mapped onto P's, or a page is out
                of range, or checksums were asked without ``kv_pool`` (nothing was submitted).
            TransferError, TPRankDied: a write could not be queued (earlier writes of the batch may
                have been; the rank batch is FAILED then and still needs ``release``).
        """
        desc = segment.descriptor
        dst_regions = rank_regions(desc)
        plan = plan_rank_writes(self.regions, dst_regions)
        src_pages, dst_pages = [int(p) for p in src_pages], [int(p) for p in dst_pages]
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
        local: list[Target] = []
        remote: dict[int, list[WriteTarget]] = {}
        writes, nbytes = [], 0
        for w in plan:  # every write is checked before anything is submitted
            src, dst = self.regions[w.src_rank], dst_regions[w.dst_rank]
            bw = block_write(w, src, dst, self.shape)
            check_pages(src_pages, src, self.shape)
            check_pages(dst_pages, dst, self.shape)
            nbytes += len(src_pages) * bw.block_bytes
            writes.append(RankPages(w.src_rank, w.dst_rank, w.head_start, w.head_end, len(src_pages),
                                    len(src_pages), bw.staged, bw.blocked))
            if w.src_rank == 0:
                seg = segment if w.dst_rank == 0 else self.transfer.open_segment(rank_descriptor(desc, w.dst_rank))
                local.append(Target(seg, dst, w))
            else:
                sub = rank_descriptor(desc, w.dst_rank)
                remote.setdefault(w.src_rank, []).append(WriteTarget(
                    sub.SerializeToString().hex(), [dst.rank, dst.head_start, dst.head_end, dst.base, dst.length],
                    w.head_start, w.head_end))
        own_sums: HeadSums = {}
        if checksums:  # before the puts read the pages (computed by now, they no longer change)
            if self.kv_pool is None:
                raise ValueError("checksums asked of a rank writer without rank 0's KV pool")
            heads = sorted({h for t in local for h in range(t.write.head_start, t.write.head_end)})
            lo = self.regions[0].head_start
            own_sums = by_head(head_checksums(self.kv_pool, src_pages, [h - lo for h in heads]), heads)
        bid = next(self._ids)
        batch = _RankBatch(None, {}, nbytes, writes, sums=own_sums)
        if local:
            batch.local = self.local.start(local, src_pages, dst_pages, not_after)  # ValueError: nothing sent
        self._batches[bid] = batch
        try:
            for rank, targets in remote.items():
                cid = next(self._cmd_ids)
                shape = [self.shape.num_layers, self.shape.page_size, self.shape.head_dim, self.shape.itemsize]
                self.group.send_command(rank, WriteCommand(cid, targets, src_pages, dst_pages, not_after,
                                                           shape, checksums).encode())
                batch.remote[rank] = cid
                self._by_cmd[cid] = bid
        except Exception as e:
            batch.failed = f"KV write not queued: {e}"
        return bid, nbytes, writes

    def _collect(self) -> None:
        for rank in range(1, len(self.regions)):
            q = self.group.replies(rank)
            while True:
                try:
                    data = q.get_nowait()
                except queue.Empty:
                    break
                d = json.loads(data)
                if "kind" in d:
                    continue  # a late answer to a timed-out query (accounting)
                reply = WriteReply(**d)
                if reply.ok:  # a follower's engine counts in its own process, which no one scrapes
                    M.TRANSFER_BYTES.inc(reply.nbytes)
                bid = self._by_cmd.pop(reply.id, None)
                if bid in self._batches:
                    self._batches[bid].replies[rank] = reply

    def status(self, bid: int) -> BatchStatus:
        """PENDING while any rank's writes may still read P's pages or write D's; then COMPLETED,
        or FAILED with the first reason. A follower that died (P's group is dead) writes nothing
        more, so its missing reply counts as failed, not pending."""
        b = self._batches[bid]
        if self.group is not None and len(self.regions) > 1:
            self._collect()
        reasons = [b.failed] if b.failed else []
        pending = False
        if b.local is not None:
            st = self.local.status(b.local)
            if st.state is State.FAILED:
                reasons.append(st.reason)
            pending |= st.state is State.PENDING
        dead = self.group.dead if self.group is not None else None
        for rank in b.remote:
            reply = b.replies.get(rank)
            if reply is None and dead:
                reasons.append(dead)
            elif reply is None:
                pending = True
            elif not reply.ok:
                reasons.append(reply.reason)
        if pending:
            return BatchStatus(State.PENDING, 0, b.nbytes)
        if reasons:
            return BatchStatus(State.FAILED, 0, b.nbytes, reasons[0])
        return BatchStatus(State.COMPLETED, b.nbytes, b.nbytes)

    def head_sums(self, bid: int) -> HeadSums:
        """A COMPLETED rank batch's checksums, every kv head written (each from the rank that
        wrote it): ``{head: [crc32 of each src page]}``; empty unless ``submit`` asked."""
        b = self._batches[bid]
        out = dict(b.sums)
        for reply in b.replies.values():
            for h, crcs in zip(reply.sum_heads, reply.sums):
                out.setdefault(int(h), [int(c) for c in crcs])
        return out

    def release(self, bid: int) -> None:
        b = self._batches.pop(bid, None)
        if b is None:
            return
        if b.local is not None:
            self.local.release(b.local)
        for cid in b.remote.values():
            self._by_cmd.pop(cid, None)
