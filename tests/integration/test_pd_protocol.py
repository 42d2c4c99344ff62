"""In-process checks of the PD protocol pieces: run merging, descriptors, the destination book's
TTL and tombstones, the prebuilt batch's ``out_cache_loc`` (from ``pre_len``, never ``[:extend_len]``), and
request validation. No processes, no model."""

from __future__ import annotations

import grpc
import pytest
import torch
from hypothesis import given, strategies as st

from decode_svc.prebuilt import delta_pages, prebuilt_out_cache_loc
from engine.errors import InvalidRequestError
from prefill_svc.destinations import DestinationBook
from prefill_svc.kv_runs import PageRun, PoolGeometry, descriptors, merge_runs
from pd_common.protocol import validate_request
from protos import common_pb2, prefill_pb2


def test_merge_runs_splits_where_either_side_breaks():
    assert merge_runs([], []) == []
    assert merge_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [PageRun(4, 0, 3), PageRun(9, 3, 2)]
    assert merge_runs([1, 2, 3], [7, 9, 10]) == [PageRun(1, 7, 1), PageRun(2, 9, 2)]
    with pytest.raises(ValueError):
        merge_runs([1, 2], [3])


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=40))
def test_merge_runs_covers_every_pair_in_order(pairs):
    src = [s for s, _ in pairs]
    dst = [d for _, d in pairs]
    runs = merge_runs(src, dst)
    flat = [(r.src + i, r.dst + i) for r in runs for i in range(r.length)]
    assert flat == list(zip(src, dst))
    for a, b in zip(runs, runs[1:]):  # maximal: neighbours cannot be joined
        assert not (b.src == a.src + a.length and b.dst == a.dst + a.length)


def test_descriptors_one_per_run_per_buffer():
    src = PoolGeometry("layer_major", (1000, 5000, 9000, 13000), 100, 40)
    dst = PoolGeometry("layer_major", (20000, 30000, 40000, 50000), 100, 40)
    runs = merge_runs([2, 3, 7], [10, 11, 0])
    d = descriptors(runs, src, dst)
    assert len(d) == 2 * 4
    assert d[0] == (1000 + 200, 20000 + 1000, 200)     # run 1, buffer K0: 2 pages
    assert d[4] == (1000 + 700, 20000 + 0, 100)        # run 2, buffer K0
    with pytest.raises(ValueError):                    # page outside the destination pool
        descriptors([PageRun(0, 39, 2)], src, dst)
    with pytest.raises(ValueError):                    # different page sizes never copy
        descriptors(runs, src, PoolGeometry("layer_major", dst.buffer_addrs, 64, 40))


def test_destination_book_ttl_claim_and_tombstones():
    now = [0.0]
    book = DestinationBook(ttl_s=5, tombstone_s=100, clock=lambda: now[0])
    d1, d2 = prefill_pb2.KVDestination(room=1), prefill_pb2.KVDestination(room=2)
    assert book.offer(d1) is None and book.offer(d2) is None
    assert book.offer(prefill_pb2.KVDestination(room=1)) == "duplicate"
    assert book.take(1) is d1 and book.take(1) is None
    now[0] = 6.0
    assert book.expire() == [d2]                      # unclaimed past the TTL: answered ok=false
    assert book.offer(prefill_pb2.KVDestination(room=2)) == "expired"
    assert book.abort(3) is None and book.offer(prefill_pb2.KVDestination(room=3)) == "aborted"
    assert book.release(3) is None and book.ended(3) == "aborted"   # the first cause stays
    assert book.release(1) is None and book.ended(1) == "ended"
    assert book.offer(prefill_pb2.KVDestination(room=1)) == "ended"
    err = book.refusal(1)
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION and str(err) == "room 1 has ended (a room is used by one request only)"
    assert book.refusal(3).code == grpc.StatusCode.ABORTED and "was aborted" in str(book.refusal(3))
    assert book.refusal(4) is None and book.ended(4) is None        # unknown room: no error
    now[0] = 200.0
    assert book.ended(1) is None and book.held_rooms() == 0


def test_prebuilt_out_cache_loc_reads_the_delta_not_the_prefix():
    """``req_to_token[row, :extend_len]`` would name the prefix slots whenever ``pre_len > 0`` (SGLang
    had that bug before its PR #24230); the delta starts at ``pre_len``."""
    ps = 4
    r2t = torch.zeros((2, 32), dtype=torch.int64)
    prefix = torch.arange(8, 16)        # pages 2, 3 from the radix cache (pre_len = 8)
    delta = torch.arange(40, 46)        # pages 10, 11 (6 prompt tokens: one and a half pages)
    r2t[1, :8] = prefix
    r2t[1, 8:14] = delta
    loc = prebuilt_out_cache_loc(r2t, 1, pre_len=8, extend_len=6)
    assert torch.equal(loc, delta)
    assert not torch.equal(loc, r2t[1, :6])   # what the buggy slice would have named
    assert delta_pages(loc, ps) == [10, 11]
    assert delta_pages(prebuilt_out_cache_loc(r2t, 1, 8, 0), ps) == []   # full hit: no page
    with pytest.raises(ValueError):
        prebuilt_out_cache_loc(r2t, 1, 30, 6)


@pytest.mark.parametrize("room,ids,sampling,field", [
    (0, [1, 2], {}, "room"),
    (1 << 63, [1, 2], {}, "room"),
    (5, [], {}, "input_ids"),
    (5, [1, 100000], {}, "input_ids"),
    (5, [1, -1], {}, "input_ids"),
    (5, [1], {"top_p": 0.0}, "top_p"),
    (5, [1], {"temperature": -1.0}, "temperature"),
    (5, [1], {"max_tokens": 0}, "max_tokens"),
    (5, list(range(1, 100)), {"max_tokens": 50}, "max_tokens"),
    (5, list(range(1, 200)), {}, "input_ids"),
])
def test_validation_names_the_field(room, ids, sampling, field):
    with pytest.raises(InvalidRequestError) as e:
        validate_request(room, ids, common_pb2.SamplingParams(**sampling), vocab_size=1000, max_context=128)
    assert e.value.field == field
    assert str(e.value).startswith(field)


def test_validation_accepts_defaults():
    p = validate_request(7, [1, 2, 3], common_pb2.SamplingParams(), vocab_size=1000, max_context=128)
    assert p.max_tokens == 16 and p.temperature == 1.0 and p.top_k == -1
