"""KV checksums per (page, kv head) (pd_common/head_checksums.py, pd_common/rank_checksums.py) and
their assembly into P's notice (prefill_svc/rank_writer.py), without processes: a sum does not
depend on how a pool splits its heads (so P of TP a and D of TP b compare), the notice holds every
head once from the rank that wrote it, and D's follower query is answered, awaited with a bound,
and a silent or failing follower is named. The sums of pools on CPU and, where there is one, on CUDA
(``head_checksums`` copies a CUDA page to the host)."""

from __future__ import annotations

import json
import queue
import time
import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from engine.kvcache.kv_pool import KVPool
from pd_common.head_checksums import NoticeSums, by_head, head_checksums, mismatches
from pd_common.rank_checksums import HeadSumQuery, HeadSumReply, answer, every_rank_sums
from pd_common.staged_writes import RankWrites
from pd_common.tp_rank import WriteReply
from prefill_svc.rank_writer import RankWriter
from tests.unit.test_rank_writer import SHAPE, Engine, Group, d_segment
from tests.unit.devices import DEVICES
from transfer_svc.rank_regions import RankRegion

GEOM = dict(page_size=4, num_layers=3, head_dim=8, dtype=torch.float32)


def _pool(heads: int, layout: str = "page_major", pages: int = 8, device: str = "cpu") -> KVPool:
    return KVPool(pages, layout=layout, num_kv_heads=heads, device=device, **GEOM)


def _filled(heads: int, layout: str = "page_major", seed: int = 0, device: str = "cpu") -> KVPool:
    pool, g = _pool(heads, layout, device=device), torch.Generator().manual_seed(seed)
    for layer in range(pool.num_layers):
        for t in (pool.k_pages(layer), pool.v_pages(layer)):
            t.copy_(torch.randn(t.shape, generator=g))
    return pool


def _holding(src: KVPool, lo: int, hi: int, layout: str = "page_major") -> KVPool:
    """A pool of the same pages holding ``src``'s kv heads ``[lo, hi)`` (a rank's shard)."""
    out = _pool(hi - lo, layout, device=src.device)
    for layer in range(src.num_layers):
        out.k_pages(layer).copy_(src.k_pages(layer)[:, :, lo:hi])
        out.v_pages(layer).copy_(src.v_pages(layer)[:, :, lo:hi])
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["page_major", "layer_major"])
def test_a_heads_sum_equals_the_page_crc_of_a_single_head_pool_holding_it(layout, device):
    full, pages = _filled(3, layout, device=device), [0, 3, 7]
    sums = head_checksums(full, pages)  # [page][head]
    assert len({c for row in sums for c in row}) == 9
    for h in range(3):
        one = _holding(full, h, h + 1)  # page_major: a page is one byte range
        raw = one.buffers()[0].cpu().view(-1).view(torch.uint8).reshape(one.num_pages, -1)
        assert [row[h] for row in sums] == [zlib.crc32(raw[p].numpy().tobytes()) for p in pages]
    # any split of the heads over ranks gives the same sums, head by head
    for split in ([(0, 2), (2, 3)], [(0, 1), (1, 3)], [(0, 1), (1, 2), (2, 3)]):
        by_rank = [head_checksums(_holding(full, lo, hi, layout), pages) for lo, hi in split]
        assert [[c for r in by_rank for c in r[i]] for i in range(len(pages))] == sums
    assert head_checksums(full, pages, heads=[2]) == [[row[2]] for row in sums]


@pytest.mark.parametrize("device", DEVICES)
def test_a_changed_byte_changes_only_its_heads_sum(device):
    pool = _filled(3, device=device)
    before = head_checksums(pool, [5])
    pool.v_pages(2)[5, 3, 1, 7] += 1.0  # layer 2 V, token 3, kv head 1
    after = head_checksums(pool, [5])
    assert [i for i in range(3) if before[0][i] != after[0][i]] == [1]


def test_the_notice_holds_every_head_once_from_the_rank_that_wrote_it():
    # P TP=2 (heads 0-1 on rank 0, head 2 on rank 1) -> D of 3 heads: two batches of a job,
    # completed in reverse order; the flat notice equals the sums of one pool holding every head
    shape_pool = dict(page_size=SHAPE.page_size, num_layers=SHAPE.num_layers, head_dim=SHAPE.head_dim,
                      dtype=torch.float32)
    full = KVPool(8, layout="page_major", num_kv_heads=3, **shape_pool)
    g = torch.Generator().manual_seed(1)
    for layer in range(full.num_layers):
        for t in (full.k_pages(layer), full.v_pages(layer)):
            t.copy_(torch.randn(t.shape, generator=g))
    rank0 = KVPool(8, layout="page_major", num_kv_heads=2, **shape_pool)
    rank1 = KVPool(8, layout="page_major", num_kv_heads=1, **shape_pool)
    for layer in range(full.num_layers):
        for dst, lo, hi in ((rank0, 0, 2), (rank1, 2, 3)):
            dst.k_pages(layer).copy_(full.k_pages(layer)[:, :, lo:hi])
            dst.v_pages(layer).copy_(full.v_pages(layer)[:, :, lo:hi])
    group, eng = Group(), Engine()
    regions = [RankRegion(0, 0, 2, 1 << 20, 8 * SHAPE.stride(2)), RankRegion(1, 2, 3, 1 << 24, 8 * SHAPE.stride(1))]
    w = RankWriter(eng, group, regions, SHAPE, RankWrites(eng, rank0.region, regions[0], SHAPE, 4 * SHAPE.stride(2)),
                   kv_pool=rank0)
    sums = NoticeSums(3)
    batches = [(2, [4, 1], [0, 1]), (4, [6], [2])]  # (first logical page, P pages, D pages)
    bids = [w.submit(d_segment(), src, dst, None, checksums=True)[0] for _, src, dst in batches]
    for (rank, cmd), (_, src, _) in zip(group.commands, batches):
        assert rank == 1 and cmd.checksums and cmd.src_pages == src
        # what rank 1's WriteAgent.written_sums answers: its heads' sums of the command's pages
        group.queues[1].put(WriteReply(cmd.id, True, sum_heads=[2],
                                       sums=[[r[0] for r in head_checksums(rank1, src)]]).encode())
    for bid in bids:
        eng.states[bid] = eng.states[bid].COMPLETED
    for (first, _, _), bid in reversed(list(zip(batches, bids))):
        assert w.status(bid).state.name == "COMPLETED"
        got = w.head_sums(bid)
        assert sorted(got) == [0, 1, 2]
        sums.add(first, got)
    want = [c for row in head_checksums(full, [4, 1, 6]) for c in row]
    assert sums.flat(2, 5) == want
    with pytest.raises(ValueError, match="kv head 0 for logical page 5"):
        sums.flat(2, 6)
    # a head a second rank also reports (replicated on P) keeps the writer's sum
    sums.add(2, {0: [12345]})
    assert sums.flat(2, 5) == want


def test_a_rank_writer_without_checksums_asks_none():
    group = Group()
    eng, region = Engine(), RankRegion(0, 0, 2, 1 << 20, 8 * SHAPE.stride(2))
    w = RankWriter(eng, group, [region], SHAPE, RankWrites(eng, torch.zeros(1), region, SHAPE, 4 * SHAPE.stride(2)))
    bid, _, _ = w.submit(d_segment(heads=2), [0], [0], None)
    assert w.head_sums(bid) == {}


def _rank(pool: KVPool, lo: int, hi: int):
    """A follower's view as rank_checksums reads it: its pool and the kv heads it holds."""
    return SimpleNamespace(kv_pool=pool, tp_shard=SimpleNamespace(kv_heads=(lo, hi)), tp=None)


@dataclass
class FollowerPipe:
    """D's TP group seen from rank 0: a command to rank r is answered by ``answer`` over
    ``followers[r]``'s pool (the follower's own code), or not at all (``silent``)."""

    followers: dict
    size: int = 2
    silent: set = field(default_factory=set)
    queues: dict = field(default_factory=dict)

    def __post_init__(self):
        self.queues = {r: queue.Queue() for r in self.followers}

    def send_command(self, rank, payload):
        if rank not in self.silent:
            self.queues[rank].put(answer(json.loads(payload), rank, self.followers[rank]).encode())

    def replies(self, rank):
        return self.queues[rank]


def test_every_rank_answers_its_heads_sums_and_a_mismatch_names_the_rank_and_head():
    full = _filled(3)
    r0, r1 = _holding(full, 0, 2), _holding(full, 2, 3)
    group = FollowerPipe({1: _rank(r1, 2, 3)})
    runner = SimpleNamespace(kv_pool=r0, tp_shard=SimpleNamespace(kv_heads=(0, 2)), tp=group)
    group.queues[1].put(WriteReply(9, True).encode())  # someone else's reply stays in the queue
    ranks = every_rank_sums(runner, [1, 6])
    assert [(r.rank, r.head_start, r.head_end) for r in ranks] == [(0, 0, 2), (1, 2, 3)]
    notice = [c for row in head_checksums(full, [1, 6]) for c in row]
    assert all(mismatches(notice, 3, r.head_start, r.sums) == [] for r in ranks)
    assert WriteReply(**json.loads(group.queues[1].get_nowait())).id == 9
    r1.k_pages(0)[6, 0, 0, 0] += 1.0  # rank 1's copy of page 6 (delta page 1), kv head 2
    ranks = every_rank_sums(runner, [1, 6])
    assert mismatches(notice, 3, 0, ranks[0].sums) == []
    assert mismatches(notice, 3, ranks[1].head_start, ranks[1].sums) == [(1, 2)]


def test_a_silent_or_failing_follower_is_named():
    full = _filled(3)
    group = FollowerPipe({1: _rank(_holding(full, 2, 3), 2, 3)}, silent={1})
    runner = SimpleNamespace(kv_pool=_holding(full, 0, 2), tp_shard=SimpleNamespace(kv_heads=(0, 2)), tp=group)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 1 did not answer the head_sums query"):
        every_rank_sums(runner, [0], timeout_s=0.2)
    assert time.monotonic() - t0 < 5
    group.silent.clear()
    group.followers[1] = _rank(_pool(1, pages=4), 2, 3)  # a follower whose pool is short of page 6
    with pytest.raises(ValueError, match="rank 1 could not sum the pages: IndexError"):
        every_rank_sums(runner, [6])  # answered with the error, not left to the timeout


def test_a_malformed_query_is_answered_with_an_error_not_raised():
    rank = _rank(_pool(1), 2, 3)
    got = answer({"id": 4, "kind": "head_sums"}, 1, rank)  # no pages
    assert got.id == 4 and got.sums == [] and "KeyError" in got.error
    ok = answer(json.loads(HeadSumQuery(5, [0, 1]).encode()), 1, rank)
    assert ok == HeadSumReply(5, 1, 2, 3, head_checksums(rank.kv_pool, [0, 1]))
    assert by_head(ok.sums, [2]) == {2: [row[0] for row in ok.sums]}
