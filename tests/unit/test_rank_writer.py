"""prefill_svc/rank_writer.py: a rank batch over P's ranks (rank 0's own engine batches plus the
followers' write commands) is PENDING while any rank may still read P's pages or write D's, even
when another rank already failed; FAILED or COMPLETED only once every rank answered (or P's group
died); a D whose kv heads no P rank holds is refused before anything is sent."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

import torch

from pd_common.head_slices import PageShape
from pd_common.staged_writes import RankWrites
from pd_common.tp_rank import WriteCommand, WriteReply
from prefill_svc.rank_writer import RankWriter
from protos import registry_pb2
from transfer_svc.digest import descriptor_digest
from transfer_svc.engine import BatchStatus, State
from transfer_svc.rank_regions import RankRegion

SHAPE = PageShape(2, 4, 2, 4)


class Engine:
    """Rank 0's transfer engine: batches complete or fail when the test says."""

    def __init__(self):
        self.states: dict[int, State] = {}
        self.submitted: list[tuple[str, list]] = []
        self.released: list[int] = []

    def submit(self, seg, descs, *, not_after=None) -> int:
        bid = len(self.states) + 1
        self.states[bid] = State.PENDING
        self.submitted.append((seg.name, descs))
        return bid

    def open_segment(self, desc):
        return Seg(desc)

    def status(self, bid) -> BatchStatus:
        st = self.states[bid]
        return BatchStatus(st, 0, 0, "peer gone" if st is State.FAILED else "")

    def release(self, bid) -> None:
        self.released.append(bid)


@dataclass
class Group:
    size: int = 2
    dead: str | None = None
    commands: list[tuple[int, WriteCommand]] = field(default_factory=list)
    queues: dict[int, queue.Queue] = field(default_factory=lambda: {1: queue.Queue()})

    def send_command(self, rank, payload):
        self.commands.append((rank, WriteCommand.decode(payload)))

    def replies(self, rank):
        return self.queues[rank]


class Seg:
    def __init__(self, desc):
        self.descriptor, self.kv_layout, self.name = desc, desc.kv_layout, desc.name


def d_segment(heads: int = 3) -> Seg:
    d = registry_pb2.SegmentDescriptor(name="d", incarnation="i", worker_address=b"w" * 16)
    d.kv_layout.layout, d.kv_layout.kv_heads = "page_major", heads
    d.regions.add(base=1 << 30, length=8 * SHAPE.stride(heads), rkey=b"k")
    d.digest = descriptor_digest(d)
    return Seg(d)


def writer(group=None):
    eng = Engine()
    regions = [RankRegion(0, 0, 2, 1 << 20, 8 * SHAPE.stride(2)), RankRegion(1, 2, 3, 1 << 24, 8 * SHAPE.stride(1))]
    local = RankWrites(eng, torch.zeros(8, 2, 2, 4, 2, 2), regions[0], SHAPE, 4 * SHAPE.stride(2))
    return eng, RankWriter(eng, group, regions, SHAPE, local)


def test_a_failed_rank_is_reported_only_once_every_rank_stopped_writing():
    group = Group()
    eng, w = writer(group)
    seg = d_segment()
    assert w.per_rank(seg) and w.refusal(seg) is None
    bid, nbytes, writes = w.submit(seg, [1, 2], [5, 6], None)
    # P TP=2 -> D TP=1: each P rank sends its whole pages, one put per page, head-blocked in D's
    assert [(x.src_rank, x.dst_rank, x.head_start, x.head_end, x.pages, x.descriptors, x.staged, x.blocked)
            for x in writes] == [(0, 0, 0, 2, 2, 2, False, True), (1, 0, 2, 3, 2, 2, False, True)]
    assert w.head_cuts(seg) == [0, 2, 3]
    (_, descs), = eng.submitted
    assert descs == [((1 << 20) + 1 * SHAPE.stride(2), (1 << 30) + 5 * SHAPE.stride(3), SHAPE.stride(2)),
                     ((1 << 20) + 2 * SHAPE.stride(2), (1 << 30) + 6 * SHAPE.stride(3), SHAPE.stride(2))]
    (rank, cmd), = group.commands
    assert rank == 1 and cmd.src_pages == [1, 2] and cmd.dst_pages == [5, 6]
    assert [(t.head_start, t.head_end) for t in cmd.targets] == [(2, 3)]
    eng.states[1] = State.FAILED
    assert w.status(bid).state is State.PENDING  # rank 1 may still be writing D's pages
    group.queues[1].put(WriteReply(cmd.id, True, puts=16, nbytes=128).encode())
    st = w.status(bid)
    assert st.state is State.FAILED and st.reason == "rank 0: peer gone"
    w.release(bid)
    assert eng.released == [1]


def test_completed_once_every_rank_completed_and_a_dead_group_fails_what_waits_for_it():
    group = Group()
    eng, w = writer(group)
    bid, _, _ = w.submit(d_segment(), [0], [0], None)
    eng.states[1] = State.COMPLETED
    assert w.status(bid).state is State.PENDING
    group.queues[1].put(WriteReply(group.commands[0][1].id, True).encode())
    assert w.status(bid).state is State.COMPLETED
    bid2, _, _ = w.submit(d_segment(), [1], [1], None)
    eng.states[2] = State.COMPLETED
    group.dead = "tensor-parallel rank 1 (pid 7) exited with signal 9"
    st = w.status(bid2)
    assert st.state is State.FAILED and "rank 1" in st.reason


def test_a_decode_of_other_kv_heads_is_refused():
    _, w = writer(Group())
    assert "kv head 3 of decode rank 0 is held by no prefill rank" in w.refusal(d_segment(heads=4))


def test_a_followers_written_bytes_count_in_rank_0s_transfer_bytes():
    # a follower's transfer engine counts in its own process (no /metrics): rank 0 counts its reply
    from telemetry import metrics

    group = Group()
    eng, w = writer(group)
    before = metrics.TRANSFER_BYTES._value.get()
    bid, nbytes, writes = w.submit(d_segment(), [1, 2], [5, 6], None)
    eng.states[1] = State.COMPLETED
    follower = 2 * SHAPE.stride(1)  # rank 1 writes its one kv head of two pages
    group.queues[1].put(WriteReply(group.commands[0][1].id, True, puts=2, nbytes=follower).encode())
    assert w.status(bid).state is State.COMPLETED
    w.status(bid)  # asked again: counted once
    assert metrics.TRANSFER_BYTES._value.get() - before == follower
    bid2, _, _ = w.submit(d_segment(), [3], [7], None)
    group.queues[1].put(WriteReply(group.commands[1][1].id, False, "peer gone").encode())
    w.status(bid2)
    assert metrics.TRANSFER_BYTES._value.get() - before == follower  # a failed write moved nothing counted
