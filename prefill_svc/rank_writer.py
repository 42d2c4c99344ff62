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
``head_sums`` gives the batch's sums of every head written, each from its writer.

Serving uses strided per-rank puts: one put per (page, layer, K/V, token) whenever the two sides
split the kv heads differently (one put per page run when the splits match). Measured on CPU
(``python -m bench.tp_transfer``, bench/results/tp_transfer_cpu_table.txt) a staging gather per
destination rank's head range (copy into a staging buffer, one put per page, a scatter on D where
D holds more heads than the writer) is 40-75x faster for mismatched splits (512 pages P2->D1:
27.4 s strided vs 0.61 s gathered); it is not wired into serving yet (it needs a registered
staging buffer on every P rank and the scatter on D before the notice).
"""

from __future__ import annotations

import itertools
import json
import queue
from collections.abc import Sequence
from dataclasses import dataclass, field

from pd_common.head_checksums import HeadSums, by_head, head_checksums
from pd_common.head_slices import PageShape, RankWrite, plan_rank_writes, slice_descriptors
from pd_common.tp_rank import WriteCommand, WriteReply, WriteTarget
from transfer_svc.engine import BatchStatus, DescriptorError, State
from transfer_svc.rank_regions import RankRegion, rank_descriptor, rank_regions


@dataclass(frozen=True)
class RankPages:
    """What one (P rank, D rank) write of a batch moved: pages of heads ``[head_start, head_end)``."""

    src_rank: int
    dst_rank: int
    head_start: int
    head_end: int
    pages: int


@dataclass
class _RankBatch:
    local: list[int]                      # rank 0's batch ids
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
        kv_pool: rank 0's KV pool (its heads' checksums); None: checksums cannot be asked.
    """

    def __init__(self, transfer, group, regions: Sequence[RankRegion], shape: PageShape, kv_pool=None):
        self.transfer, self.group, self.regions, self.shape = transfer, group, list(regions), shape
        self.kv_pool = kv_pool
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
        local: list[tuple[RankWrite, object, list]] = []
        remote: dict[int, list[WriteTarget]] = {}
        nbytes = 0
        for w in plan:  # every descriptor is built (and checked) before anything is submitted
            src, dst = self.regions[w.src_rank], dst_regions[w.dst_rank]
            descs = slice_descriptors(w, src, dst, self.shape, src_pages, dst_pages)
            nbytes += sum(d[2] for d in descs)
            if w.src_rank == 0:
                local.append((w, dst, descs))
            else:
                sub = rank_descriptor(desc, w.dst_rank)
                remote.setdefault(w.src_rank, []).append(WriteTarget(
                    sub.SerializeToString().hex(), [dst.rank, dst.head_start, dst.head_end, dst.base, dst.length],
                    w.head_start, w.head_end))
        writes = [RankPages(w.src_rank, w.dst_rank, w.head_start, w.head_end, len(src_pages)) for w in plan]
        own_sums: HeadSums = {}
        if checksums:  # before the puts read the pages (computed by now, they no longer change)
            if self.kv_pool is None:
                raise ValueError("checksums asked of a rank writer without rank 0's KV pool")
            heads = sorted({h for w, _, _ in local for h in range(w.head_start, w.head_end)})
            lo = self.regions[0].head_start
            own_sums = by_head(head_checksums(self.kv_pool, src_pages, [h - lo for h in heads]), heads)
        bid = next(self._ids)
        batch = self._batches[bid] = _RankBatch([], {}, nbytes, writes, sums=own_sums)
        try:
            for w, dst, descs in local:
                seg = segment if w.dst_rank == 0 else self.transfer.open_segment(rank_descriptor(desc, w.dst_rank))
                batch.local.append(self.transfer.submit(seg, descs, not_after=not_after))
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
        for lb in b.local:
            st = self.transfer.status(lb)
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
        for lb in b.local:
            self.transfer.release(lb)
        for cid in b.remote.values():
            self._by_cmd.pop(cid, None)
