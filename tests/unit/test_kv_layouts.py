"""KV pool layouts on the PD path, in one process with real CPU pools: the KVLayout a worker
publishes, the transfer descriptors P builds from it (a page_major run is ONE write, a layer_major
run one per layer per K/V), that those descriptors move exactly the right bytes (copied here with
memmove, as a put would), a layout mismatch's error, and page checksums that do not depend on the
layout."""

from __future__ import annotations

import ctypes
import zlib

import pytest
import torch

from engine.kvcache.kv_pool import KVPool
from pd_common.head_checksums import head_checksums
from pd_common.protocol import kv_layout
from prefill_svc.kv_runs import PoolGeometry, descriptors, merge_runs

SHAPE = dict(page_size=4, num_layers=32, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def _pool(layout: str, num_pages: int = 16, seed: int | None = None) -> KVPool:
    pool = KVPool(num_pages, layout=layout, **SHAPE)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for layer in range(pool.num_layers):
            pool.k_pages(layer).copy_(torch.randn(pool.k_pages(layer).shape, generator=g))
            pool.v_pages(layer).copy_(torch.randn(pool.v_pages(layer).shape, generator=g))
    return pool


def _geometry(pool: KVPool) -> PoolGeometry:
    return PoolGeometry.from_layout(kv_layout(pool, "test-model"))


def _put(descs) -> None:
    for src, dst, n in descs:  # what one UCX put does, on local memory
        ctypes.memmove(dst, src, n)


def test_kv_layout_describes_the_pool():
    pm, lm = _pool("page_major"), _pool("layer_major")
    a, b = kv_layout(pm, "m"), kv_layout(lm, "m")
    assert a.layout == "page_major" and list(a.buffer_addrs) == [pm.buffers()[0].data_ptr()]
    assert a.page_bytes == b.page_bytes == 4 * 2 * 8 * 4
    assert a.page_stride_bytes == 64 * a.page_bytes and b.page_stride_bytes == b.page_bytes
    assert b.layout == "layer_major" and list(b.buffer_addrs) == [t.data_ptr() for t in lm.buffers()]
    assert len(b.buffer_addrs) == 64 and _geometry(pm).contiguous_pages


@pytest.mark.parametrize("layout,per_run", [("page_major", 1), ("layer_major", 64)])
def test_descriptors_per_run_and_bytes_moved(layout, per_run):
    src, dst = _pool(layout, seed=1), _pool(layout)
    src_pages, dst_pages = [2, 3, 4, 5, 9, 10], [7, 8, 9, 10, 0, 1]   # runs of 4 and 2 pages
    runs = merge_runs(src_pages, dst_pages)
    descs = descriptors(runs, _geometry(src), _geometry(dst))
    assert len(descs) == 2 * per_run
    if layout == "page_major":  # a 4-page run is one write of 4 whole pages (every layer, K and V)
        assert descs[0] == (src.buffers()[0].data_ptr() + 2 * src.page_stride_bytes,
                            dst.buffers()[0].data_ptr() + 7 * dst.page_stride_bytes, 4 * src.page_stride_bytes)
    assert sum(n for _, _, n in descs) == 6 * 64 * src.page_bytes
    _put(descs)
    for layer in range(32):
        for s, d in zip(src_pages, dst_pages):
            assert torch.equal(dst.k_pages(layer)[d], src.k_pages(layer)[s])
            assert torch.equal(dst.v_pages(layer)[d], src.v_pages(layer)[s])
    untouched = sorted(set(range(16)) - set(dst_pages))
    assert all(dst.k_pages(layer)[untouched].count_nonzero() == 0 for layer in range(32))
    assert head_checksums(dst, dst_pages) == head_checksums(src, src_pages)


def test_page_major_with_padded_pages_writes_page_by_page():
    pm = _pool("page_major")
    g = _geometry(pm)
    padded = PoolGeometry("page_major", (1 << 20,), g.page_bytes, 16, g.page_stride_bytes + 256, 64)
    d = descriptors(merge_runs([0, 1, 2], [5, 6, 7]), g, padded)
    per_page = 64 * g.page_bytes
    assert [(s - g.buffer_addrs[0], r - (1 << 20), n) for s, r, n in d] == [
        (p * per_page, (5 + p) * (per_page + 256), per_page) for p in range(3)]


def test_layout_mismatch_is_a_clear_error():
    pm, lm = _geometry(_pool("page_major")), _geometry(_pool("layer_major"))
    why = pm.compatible(lm)
    assert "page_major" in why and "layer_major" in why and "--kv-layout" in why
    with pytest.raises(ValueError, match="--kv-layout"):
        descriptors(merge_runs([0], [0]), pm, lm)
    other = KVPool(16, page_size=4, num_layers=30, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    assert "buffers per page" in pm.compatible(_geometry(other))
    assert "--model" in pm.compatible(_geometry(other))


@pytest.mark.parametrize("change,flag", [(dict(dtype=torch.float16), "--dtype"),
                                         (dict(page_size=8), "--page-size"),
                                         (dict(head_dim=16), "--model")])
def test_pools_that_differ_name_the_flag(change, flag):
    """bfloat16 and float16 pages have the same size: without the dtype check a bf16 P and an fp16 D
    passed every check and D decoded from reinterpreted bytes (garbage text, no error)."""
    bf16 = dict(SHAPE, dtype=torch.bfloat16)
    here = _geometry(KVPool(16, layout="page_major", **bf16))
    peer = _geometry(KVPool(16, layout="page_major", **dict(bf16, **change)))
    why = here.compatible(peer)
    assert why and flag in why, why
    with pytest.raises(ValueError, match=flag):
        descriptors(merge_runs([0], [0]), here, peer)
    assert here.compatible(_geometry(KVPool(16, layout="page_major", **bf16))) is None


def test_page_checksums_do_not_depend_on_the_layout():
    pm, lm = _pool("page_major", seed=3), _pool("layer_major", seed=3)
    for layer in range(32):
        assert torch.equal(pm.k_pages(layer), lm.k_pages(layer))
    pages = [0, 5, 15]
    sums = head_checksums(pm, pages)  # [page][kv head]
    assert sums == head_checksums(lm, pages) and len({c for row in sums for c in row}) == 6
    # page_major: head h's sum is the crc32 of its slices of the page's one byte range, in order
    region = pm.buffers()[0].view(-1).view(torch.uint8)
    raw = region[5 * pm.page_stride_bytes:6 * pm.page_stride_bytes].reshape(2 * 32 * 4, 2, 8 * 4)
    assert sums[1] == [zlib.crc32(raw[:, h].contiguous().numpy().tobytes()) for h in range(2)]


def test_prefill_names_a_decode_of_another_page_size_before_counting_its_pages():
    """A D of --page-size 32 sends fewer destination pages than P (16) counts for the delta; P's check
    reports the page size (naming --page-size) rather than "destination has 2 pages; the delta needs 3"."""
    from prefill_svc.destinations import check_destination
    from prefill_svc.jobs import Destination
    from protos import prefill_pb2

    here = _geometry(KVPool(16, layout="page_major", **dict(SHAPE, page_size=16)))
    peer = _geometry(KVPool(16, layout="page_major", **dict(SHAPE, page_size=32)))
    n = 40  # 3 pages of 16 tokens, 2 of 32
    msg = prefill_pb2.KVDestination(room=1, dst_page_ids=[0, 1], pre_len=0, prompt_len=n)
    why = check_destination(Destination(msg, None, peer), n, 16, here)
    assert why and "--page-size" in why, why
    same = Destination(prefill_pb2.KVDestination(room=1, dst_page_ids=[0, 1, 2], prompt_len=n), None, here)
    assert check_destination(same, n, 16, here) is None
