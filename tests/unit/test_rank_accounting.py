"""pd_common/rank_accounting.py without processes: the reply pipe it shares with P's write replies,
the page-table digest, and which fields it names."""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace

import pytest
import torch

from pd_common.rank_accounting import AccountingReply, answer, await_reply, disagreements, rank_accounting, table_crc
from pd_common.tp_rank import WriteReply
from protos import common_pb2


def test_the_awaited_reply_leaves_write_replies_and_descriptors_in_the_queue():
    q: queue.Queue = queue.Queue()
    write, desc = WriteReply(7, True, puts=3).encode(), b"\x0a\xd5\x01binary descriptor"
    for data in (write, AccountingReply(1, 1, 8, 2, 1, 99).encode(), desc, AccountingReply(2, 1, 8, 3, 1, 5).encode()):
        q.put(data)
    got = await_reply(q, 2, time.monotonic() + 5, 1)
    assert (got["id"], got["batches"], got["table_crc"]) == (2, 3, 5)
    assert sorted([q.get_nowait(), q.get_nowait()]) == sorted([write, desc]) and q.empty()  # stale reply 1 dropped


def test_no_answer_is_a_timeout_naming_the_rank():
    with pytest.raises(TimeoutError, match="rank 3"):
        await_reply(queue.Queue(), 1, time.monotonic() + 0.05, 3)


def test_the_table_digest_covers_each_rows_slots_up_to_its_length():
    t = torch.arange(40, dtype=torch.int64).reshape(4, 10)
    ref = table_crc(t, [[1, 4], [3, 2]])
    t[1, 4] = -1  # past the row's length: not covered
    assert table_crc(t, [[1, 4], [3, 2]]) == ref
    t[3, 1] = -1
    assert table_crc(t, [[1, 4], [3, 2]]) != ref
    assert table_crc(t, []) == 0


def test_disagreements_name_each_drifted_field_of_each_follower():
    R = common_pb2.RankAccounting
    ok = [R(rank=0, pool_pages=8, batches=4, table_rows=2, table_crc=11), R(rank=1, pool_pages=8, batches=4,
                                                                            table_rows=2, table_crc=11)]
    assert disagreements(ok) == [] and disagreements([]) == [] and disagreements(ok[:1]) == []
    bad = ok + [R(rank=2, pool_pages=7, batches=4, table_rows=2, table_crc=12)]
    assert disagreements(bad) == ["rank 2 pool_pages 7 != rank 0's 8", "rank 2 table_crc 12 != rank 0's 11"]


@pytest.mark.parametrize("scratch_page", [None, 8])
def test_pool_pages_are_the_pages_requests_can_hold_without_the_graph_scratch_page(scratch_page):
    # CUDA graphs (ModelRunner.scratch_page) make the pool one page larger than its allocator, whose
    # pages KVAccounting.total_pages counts; every rank reports the same count (found on the H200:
    # P's rank 0 reported 2049 for 2048)
    runner = SimpleNamespace(kv_pool=SimpleNamespace(num_pages=8 + (scratch_page is not None)),
                             scratch_page=scratch_page, tp=None,
                             req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(2, 4, dtype=torch.int64)))
    assert [r.pool_pages for r in rank_accounting(runner)] == [8]
    assert answer({"id": 1, "rows": []}, 1, runner, 0).pool_pages == 8
