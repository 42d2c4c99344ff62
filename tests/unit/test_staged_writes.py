"""One P rank's writes (pd_common/staged_writes.py) through real transfer engines over UCX shared
memory (two engines in this process: the P rank's and a D rank's): a write of some of the rank's
heads is gathered through the bounded staging area in chunks and lands exactly, one descriptor per
page; the staging area holds nothing once the job completed, or once it failed (a write window
already passed), and is never larger than its bound. On CPU pools (UCX ``sm``) and, where there is one,
on CUDA pools (the engines registered as ``cuda:0``, UCX's own transport choice, or ``UCX_TLS``): the
gather into a registered CUDA staging area and puts from it."""

from __future__ import annotations

import time

import pytest
import torch

from pd_common.head_slices import PageShape, RankWrite
from pd_common.staged_writes import RankWrites, Target
from tests.unit.devices import DEVICES
from transfer_svc import State, TransferEngine
from transfer_svc.rank_regions import RankRegion

LAYERS, PS, HD, KV = 3, 4, 8, 3
SHAPE = PageShape(LAYERS, PS, HD, 4)


@pytest.fixture(params=DEVICES)
def pair(request):
    """(P's engine, D's engine, the pools' device)."""
    device = request.param
    tls = "sm" if device == "cpu" else None  # CUDA: UCX's choice (cuda_copy / cuda_ipc), or UCX_TLS
    p = TransferEngine(f"staged-p-{time.monotonic_ns()}", transports=tls, timeout_s=30.0)
    d = TransferEngine(f"staged-d-{time.monotonic_ns()}", transports=tls, timeout_s=30.0)
    yield p, d, device
    p.close()
    d.close()


def setup(pair, pages: int, staging_pages: int):
    """P rank 0 holding every head -> D rank 1 holding heads [2, 3) (P TP=1 -> D TP=2's rank 1)."""
    p, d, device = pair
    loc = "cpu" if device == "cpu" else "cuda:0"
    torch.manual_seed(0)
    src = torch.randn(pages, LAYERS, 2, PS, KV, HD).to(device)
    dst = torch.zeros(pages, LAYERS, 2, PS, 1, HD, device=device)
    p.register_memory(src.data_ptr(), src.numel() * 4, loc)
    d.register_memory(dst.data_ptr(), dst.numel() * 4, loc)
    me = RankRegion(0, 0, KV, src.data_ptr(), src.numel() * 4)
    d_region = RankRegion(1, 2, 3, dst.data_ptr(), dst.numel() * 4)
    writes = RankWrites(p, src, me, SHAPE, staging_pages * SHAPE.stride(KV))
    target = Target(p.open_segment(d.publish()), d_region, RankWrite(0, 1, 2, 3))
    return src, dst, writes, target


def test_a_head_slice_goes_through_bounded_staging_in_chunks_and_lands_exactly(pair):
    src, dst, writes, target = setup(pair, pages=40, staging_pages=2)  # 3 pages of one head per half
    src_pages = list(range(1, 31))
    dst_pages = [39 - i for i in range(30)]
    jid = writes.start([target], src_pages, dst_pages, time.monotonic() + 30)
    st = writes.wait(jid)
    assert st.state is State.COMPLETED, st
    assert writes.puts(jid) == (30, 30 * SHAPE.stride(1))  # one descriptor per page
    writes.release(jid)
    assert torch.equal(dst[dst_pages], src[src_pages][:, :, :, :, 2:3])
    assert writes.staging.in_use == 0
    assert 0 < writes.staging.peak <= 2 * SHAPE.stride(KV)  # never more than the bound
    untouched = sorted(set(range(40)) - set(dst_pages))
    assert not dst[untouched].any()
    writes.close()


def test_staging_is_released_when_the_write_fails(pair):
    src, dst, writes, target = setup(pair, pages=16, staging_pages=2)
    jid = writes.start([target], list(range(12)), list(range(12)), time.monotonic() - 1)  # window passed
    st = writes.wait(jid)
    assert st.state is State.FAILED and "write deadline passed" in st.reason, st
    assert writes.staging.in_use == 0 and writes.staging.peak > 0  # it gathered, then gave it back
    assert not dst.any()  # nothing reached D
    writes.release(jid)
    # the area is reusable after a failure
    jid = writes.start([target], [3], [5], time.monotonic() + 30)
    assert writes.wait(jid).state is State.COMPLETED
    assert torch.equal(dst[5], src[3][:, :, :, 2:3]) and writes.staging.in_use == 0
    writes.close()


def test_bad_pages_and_a_too_small_area_are_refused_before_anything_moves(pair):
    src, dst, writes, target = setup(pair, pages=8, staging_pages=2)
    with pytest.raises(ValueError, match="outside rank 1's region of 8 pages"):
        writes.start([target], [0], [8], None)
    with pytest.raises(ValueError, match="below two pages"):
        RankWrites(pair[0], src, writes.me, SHAPE, SHAPE.stride(KV))
    assert writes.staging.peak == 0 and not dst.any()
    writes.close()


def test_an_area_above_the_pool_is_capped_at_the_pool_and_writes_still_land(pair):
    # --kv-staging-mb 1e9 used to be accepted, then every staged write failed allocating 1 PB
    src, dst, writes, target = setup(pair, pages=8, staging_pages=2)
    pool_bytes = src.numel() * src.element_size()
    huge = RankWrites(pair[0], src, writes.me, SHAPE, int(1e9 * (1 << 20)))
    assert huge.staging.nbytes == pool_bytes
    jid = huge.start([target], list(range(8)), list(range(8)), time.monotonic() + 30)
    assert huge.wait(jid).state is State.COMPLETED
    huge.release(jid)
    assert torch.equal(dst, src[:, :, :, :, 2:3])
    writes.close()
    huge.close()
