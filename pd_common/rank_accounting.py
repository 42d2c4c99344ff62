"""Accounting on every tensor-parallel rank of a PD worker (``GetLoadRequest.per_rank``).

Rank 0 places every page; ranks 1..N-1 own none and mirror rank 0's page table from each forward
(``engine.distributed.batch_wire``). What can drift on a follower is therefore its pool (fewer
pages than rank 0 places into it), the forwards it ran (a lost or extra batch) and its page table
(a row whose slots differ from rank 0's, so its attention reads other pages). Rank 0 asks each
follower over the TP group's command channel (an ``AccountingQuery`` naming the rows of rank 0's
last forward and their lengths); the follower answers with its own ``RankAccounting`` fields
(``AccountingReply``), and rank 0 adds its own entry computed the same way. ``disagreements``
names every field of a follower that differs from rank 0's.

The rows compared are those of the last forward: rank 0 rewrites a row only for a request that has
not run yet, so once the worker is idle those rows hold what the followers were sent.
"""

from __future__ import annotations

import itertools
import json
import queue
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from protos import common_pb2

KIND = "accounting"  # the "kind" of a query and its reply on the TP command / reply pipes


@dataclass
class AccountingQuery:
    """Rank 0 -> follower: answer for ``rows`` (``[[row, seq_len], ...]``, rank 0's last forward)."""

    id: int
    rows: list[list[int]]
    kind: str = KIND

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()


@dataclass
class AccountingReply:
    """Follower -> rank 0: its ``RankAccounting`` fields."""

    id: int
    rank: int
    pool_pages: int
    batches: int
    table_rows: int
    table_crc: int
    kind: str = KIND

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()


def is_accounting(payload: dict) -> bool:
    """Whether a decoded command or reply (JSON object) is an accounting query / reply."""
    return payload.get("kind") == KIND


def table_crc(req_to_token: torch.Tensor, rows: Sequence[Sequence[int]]) -> int:
    """crc32 of ``req_to_token[row, :seq_len]`` (int64, in ``rows`` order) over ``rows``."""
    crc = 0
    for row, n in rows:
        crc = zlib.crc32(req_to_token[int(row), :int(n)].to("cpu", torch.int64).numpy().tobytes(), crc)
    return crc


def pool_pages(runner) -> int:
    """The pages of ``runner``'s KV pool that requests can hold (``KVAccounting.total_pages``): the
    pool less the CUDA-graph scratch page where graphs are on (``ModelRunner.scratch_page``)."""
    return int(runner.kv_pool.num_pages) - int(getattr(runner, "scratch_page", None) is not None)


def answer(query: dict, rank: int, runner, batches: int) -> AccountingReply:
    """A follower's reply to a decoded ``AccountingQuery`` (its pool, forwards and page table)."""
    rows = query["rows"]
    return AccountingReply(int(query["id"]), rank, pool_pages(runner), batches, len(rows),
                           table_crc(runner.req_to_token_pool.req_to_token, rows))


def last_rows(group) -> list[list[int]]:
    """Rank 0: ``[[row, seq_len], ...]`` of the group's last forward (empty before the first)."""
    if group is None or group.last_rows is None:
        return []
    rows, seq = group.last_rows
    return [[int(r), int(s)] for r, s in zip(rows.tolist(), seq.tolist())]


_ids = itertools.count(1)  # query ids, one sequence per process


def rank_accounting(runner, timeout_s: float = 10.0) -> list[common_pb2.RankAccounting]:
    """Every rank's entry, rank order; call from the thread that runs the forwards (the query
    travels behind every batch sent before it). One rank: rank 0's entry alone.

    Raises:
        TPRankDied: the group is dead or a follower's pipe is gone.
        TimeoutError: a follower did not answer within ``timeout_s`` seconds.
    """
    group = runner.tp
    rows = last_rows(group)
    r2t = runner.req_to_token_pool.req_to_token
    out = [common_pb2.RankAccounting(rank=0, pool_pages=pool_pages(runner),
                                     batches=group.batches if group is not None else 0,
                                     table_rows=len(rows), table_crc=table_crc(r2t, rows))]
    if group is None:
        return out
    for rank in range(1, group.size):
        qid = next(_ids)
        group.send_command(rank, AccountingQuery(qid, rows).encode())
        got = await_reply(group.replies(rank), qid, time.monotonic() + timeout_s, rank)
        out.append(common_pb2.RankAccounting(rank=got["rank"], pool_pages=got["pool_pages"],
                                             batches=got["batches"], table_rows=got["table_rows"],
                                             table_crc=got["table_crc"]))
    return out


def await_reply(q: queue.Queue, qid: int, deadline: float, rank: int, kind: str = KIND) -> dict:
    """The reply ``qid`` of ``kind`` (a query's "kind": accounting, or another query of the command
    pipe) as decoded JSON from ``q``, a rank's reply queue; other replies (P's write replies, a
    start-up descriptor, another kind's) go back in it, a late answer to an earlier query of
    ``kind`` is dropped.

    Raises:
        TimeoutError: no such reply by ``deadline`` (``time.monotonic()`` seconds), naming ``rank``.
    """
    others: list[bytes] = []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"tensor-parallel rank {rank} did not answer the {kind} query")
            try:
                data = q.get(timeout=left)
            except queue.Empty:
                continue
            try:
                d = json.loads(data)
            except ValueError:  # not JSON (a rank's descriptor at start-up): someone else's
                others.append(data)
                continue
            mine = isinstance(d, dict) and d.get("kind") == kind
            if mine and d.get("id") == qid:
                return d
            if not mine:  # a late answer to an earlier query of this kind is dropped
                others.append(data)
    finally:
        for data in others:
            q.put(data)


def disagreements(ranks: Sequence[common_pb2.RankAccounting]) -> list[str]:
    """Every field of ranks 1..N-1 that differs from rank 0's entry (empty: they agree)."""
    if not ranks:
        return []
    ref, out = ranks[0], []
    for r in ranks[1:]:
        for f in ("pool_pages", "batches", "table_rows", "table_crc"):
            if getattr(r, f) != getattr(ref, f):
                out.append(f"rank {r.rank} {f} {getattr(r, f)} != rank 0's {getattr(ref, f)}")
    return out
