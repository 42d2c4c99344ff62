"""Per-rank KV writes (pd_common/head_slices.py, transfer_svc/rank_regions.py): the plan and its puts
(one contiguous block per page: from the P page or a gathered staging block, into the whole D page or
head-blocked into it), applied byte for byte to real sharded pools (torch tensors standing in for the
ranks' memory) and unblocked on D (pd_common/head_blocks.py), rebuild exactly the pages a
single-rank pool would hold; the per-rank descriptor's digest covers the new fields and a
descriptor's regions are read back per rank."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pd_common.head_blocks import rank_blocks, unblock_pages
from pd_common.head_slices import (PageShape, RankWrite, block_descriptors, block_write, head_cuts, plan_rank_writes)
from protos import registry_pb2
from transfer_svc.digest import descriptor_digest
from transfer_svc.rank_regions import RankRegion, rank_descriptor, rank_regions, tp_descriptor
from transfer_svc.segments import validate_descriptor
from transfer_svc.types import DescriptorError

LAYERS, PS, HD, KV = 3, 4, 2, 3  # SmolLM2's 3 kv heads, small everything else
SHAPE = PageShape(LAYERS, PS, HD, 4)


def split(kv: int, tp: int) -> list[tuple[int, int]]:
    """The engine's head ranges (engine/distributed/shard.py) for kv >= tp, replicated below."""
    if kv >= tp:
        base, extra = divmod(kv, tp)
        out, start = [], 0
        for r in range(tp):
            n = base + (r < extra)
            out.append((start, start + n))
            start += n
        return out
    per = tp // kv
    return [(r // per, r // per + 1) for r in range(tp)]


def pools(tp: int, pages: int, full: torch.Tensor | None = None):
    """One pool per rank ``[pages, layers, 2, ps, heads, hd]``: slices of ``full`` or zeros."""
    out = []
    for lo, hi in split(KV, tp):
        t = full[:, :, :, :, lo:hi].contiguous() if full is not None else \
            torch.zeros(pages, LAYERS, 2, PS, hi - lo, HD)
        out.append(t)
    return out


def regions(ts: list[torch.Tensor], tp: int) -> list[RankRegion]:
    return [RankRegion(r, lo, hi, t.data_ptr(), t.numel() * 4) for r, ((lo, hi), t) in enumerate(zip(split(KV, tp), ts))]


def apply(plan, src_t, dst_t, src, dst, src_pages, dst_pages) -> int:
    """Every write's descriptors applied with memmove (a staged write gathered first, as
    pd_common/staged_writes.py does), then D's blocked pages unblocked -> descriptors used."""
    used = 0
    for w in plan:
        bw = block_write(w, src[w.src_rank], dst[w.dst_rank], SHAPE)
        staging = None
        if bw.staged:
            lo = bw.src_head_offset
            staging = src_t[w.src_rank][src_pages][:, :, :, :, lo:lo + w.head_end - w.head_start].contiguous()
        descs = block_descriptors(bw, src[w.src_rank], dst[w.dst_rank], SHAPE, src_pages, dst_pages,
                                  staging.data_ptr() if staging is not None else None)
        assert len(descs) == len(src_pages) and {n for _, _, n in descs} == {bw.block_bytes}
        for la, ra, n in descs:
            ctypes.memmove(ra, la, n)
        used += len(descs)
    for d, t in zip(dst, dst_t):
        unblock_pages(t, dst_pages, rank_blocks(head_cuts(plan), d.head_start, d.head_end))
    return used


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (2, 2), (1, 3), (3, 2), (6, 1), (2, 6)])
def test_rank_writes_rebuild_the_delta_pages(p_tp, d_tp):
    torch.manual_seed(0)
    full = torch.randn(6, LAYERS, 2, PS, KV, HD)
    src_t, dst_t = pools(p_tp, 6, full), pools(d_tp, 8)
    src, dst = regions(src_t, p_tp), regions(dst_t, d_tp)
    src_pages, dst_pages = [1, 2, 4], [7, 0, 3]
    plan = plan_rank_writes(src, dst)
    for d in dst:  # every D head is written exactly once
        got = sorted(h for w in plan if w.dst_rank == d.rank for h in range(w.head_start, w.head_end))
        assert got == list(range(d.head_start, d.head_end))
    apply(plan, src_t, dst_t, src, dst, src_pages, dst_pages)
    want = torch.zeros(8, LAYERS, 2, PS, KV, HD)
    want[dst_pages] = full[src_pages]
    for (lo, hi), t in zip(split(KV, d_tp), dst_t):
        assert torch.equal(t, want[:, :, :, :, lo:hi])


@pytest.mark.parametrize("p_tp,d_tp,staged,blocked", [
    (2, 1, [], [(0, 0), (1, 0)]),          # whole P pages into head-blocked D pages
    (1, 2, [(0, 0), (0, 1)], []),          # P gathers each D rank's heads; whole D pages
    (3, 2, [], [(0, 0), (1, 0)]),          # P ranks 0, 1 fill D rank 0's page in two blocks
    (2, 2, [], []),                        # the same split: whole pages both sides
])
def test_every_write_is_one_contiguous_put_per_page(p_tp, d_tp, staged, blocked):
    src = [RankRegion(r, lo, hi, (r + 1) << 32, 64 * SHAPE.stride(hi - lo)) for r, (lo, hi) in enumerate(split(KV, p_tp))]
    dst = [RankRegion(r, lo, hi, (r + 9) << 32, 64 * SHAPE.stride(hi - lo)) for r, (lo, hi) in enumerate(split(KV, d_tp))]
    pages = list(range(40))
    descs, got_staged, got_blocked = 0, [], []
    for w in plan_rank_writes(src, dst):
        bw = block_write(w, src[w.src_rank], dst[w.dst_rank], SHAPE)
        d = block_descriptors(bw, src[w.src_rank], dst[w.dst_rank], SHAPE, pages, pages[::-1], staging_addr=1 << 20)
        assert len(d) == len(pages)  # the strided plan had 2 * layers * page_size per page
        assert all(n == SHAPE.stride(w.head_end - w.head_start) for _, _, n in d)
        dst_off = SHAPE.stride(w.head_start - dst[w.dst_rank].head_start)
        assert d[0][1] == dst[w.dst_rank].base + 39 * SHAPE.stride(dst[w.dst_rank].heads) + dst_off
        descs += len(d)
        if bw.staged:
            got_staged.append((w.src_rank, w.dst_rank))
        if bw.blocked:
            got_blocked.append((w.src_rank, w.dst_rank))
    assert (got_staged, got_blocked) == (staged, blocked)
    assert descs == len(pages) * len(plan_rank_writes(src, dst))


def test_unmappable_heads_and_pages_are_refused():
    a = [RankRegion(0, 0, 2, 1 << 20, 10 * SHAPE.stride(2))]
    b = [RankRegion(0, 0, 3, 1 << 30, 10 * SHAPE.stride(3))]
    with pytest.raises(ValueError, match="kv head 2 of decode rank 0 is held by no prefill rank"):
        plan_rank_writes(a, b)
    bw = block_write(RankWrite(0, 0, 0, 2), a[0], b[0], SHAPE)
    with pytest.raises(ValueError, match="outside rank 0's region of 10 pages"):
        block_descriptors(bw, a[0], b[0], SHAPE, [10], [0])
    with pytest.raises(ValueError, match="outside rank 0's"):
        block_write(RankWrite(0, 0, 1, 3), a[0], b[0], SHAPE)
    with pytest.raises(ValueError, match="need staging"):
        block_descriptors(block_write(RankWrite(0, 0, 0, 1), a[0], b[0], SHAPE), a[0], b[0], SHAPE, [0], [0])


def _desc(name: str, addr: bytes, base: int) -> registry_pb2.SegmentDescriptor:
    d = registry_pb2.SegmentDescriptor(name=name, incarnation="inc", worker_address=addr)
    d.kv_layout.layout, d.kv_layout.kv_heads, d.kv_layout.tp_size = "page_major", KV, 2
    d.regions.add(base=base, length=4096, rkey=b"k" * 8, location="cpu")
    d.digest = descriptor_digest(d)
    return d


def test_tp_descriptor_lists_every_rank_and_its_digest_covers_them():
    from decode_svc.messages import ProcessId

    rank0, rank1 = _desc("d", b"a" * 16, 1 << 20), _desc("d#rank1", b"b" * 16, 1 << 20)  # same address
    rank0.pid, rank0.pid_start_ticks, rank1.pid, rank1.pid_start_ticks = 100, 5, 4321, 7
    desc = tp_descriptor(rank0, [(0, 2), (2, 3)], [rank1])
    validate_descriptor(desc)  # two processes' regions may share an address
    # the follower posts its own puts: its process travels with its region, for proofs of death
    assert ProcessId.of(desc) == ProcessId("", 100, 5, ((4321, 7),))
    assert rank_regions(desc) == [RankRegion(0, 0, 2, 1 << 20, 4096), RankRegion(1, 2, 3, 1 << 20, 4096)]
    sub = rank_descriptor(desc, 1)
    validate_descriptor(sub)
    assert sub.name == "d#rank1" and sub.worker_address == b"b" * 16 and len(sub.regions) == 1
    desc.regions[1].kv_head_start = 1  # an edited head range no longer matches the digest
    with pytest.raises(DescriptorError, match="digest mismatch"):
        validate_descriptor(desc)


def test_a_single_rank_descriptor_is_one_region_with_every_head():
    d = _desc("old", b"a" * 16, 1 << 20)
    d.kv_layout.tp_size = 0
    assert rank_regions(d) == [RankRegion(0, 0, KV, 1 << 20, 4096)]


def test_the_router_pairs_pools_of_any_tp_split_and_refuses_other_heads():
    """router_svc/worker.py compares the published layouts, which describe every rank's kv heads."""
    from engine.kvcache.kv_pool import KVPool
    from pd_common.protocol import kv_layout
    from router_svc.worker import kv_page_bytes, kv_signature

    def layout(heads, tp, total):
        return kv_layout(KVPool(4, PS, LAYERS, heads, HD, torch.float32, torch.device("cpu")), "m", tp, total)

    one, rank0_of_two = layout(KV, 1, None), layout(2, 2, KV)
    assert kv_signature(one) == kv_signature(rank0_of_two) and rank0_of_two.tp_size == 2 and one.tp_size == 0
    assert kv_page_bytes(one) == kv_page_bytes(rank0_of_two) == SHAPE.stride(KV)
    assert PageShape.from_layout(rank0_of_two) == SHAPE
    assert kv_signature(layout(2, 2, 4)) != kv_signature(one)  # other kv heads: cannot map, never paired
