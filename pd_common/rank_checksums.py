"""KV checksums over every tensor-parallel rank of a worker (``--kv-checksums``, D's side).

Each rank's pool holds only its kv heads, so a check of a page's KV must ask every rank. Rank 0
sends each follower a ``HeadSumQuery`` (the physical pages) on the TP command pipe, computes its
own heads' sums meanwhile, then waits (bounded) for each ``HeadSumReply``. The query travels behind
every batch and command sent before it, and a follower answers it on the thread that runs its
forwards and commands, so the sums cover what every earlier forward and command left in the pages.
Sums are per (page, kv head): ``pd_common.head_checksums``.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from pd_common.head_checksums import head_checksums
from pd_common.rank_accounting import await_reply

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

KIND = "head_sums"  # the "kind" of a query and its reply on the TP command / reply pipes


@dataclass
class HeadSumQuery:
    """Rank 0 -> follower: the sums of ``pages`` (physical page ids) for every kv head it holds."""

    id: int
    pages: list[int]
    kind: str = KIND

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()


@dataclass
class HeadSumReply:
    """Follower -> rank 0: ``sums[i][j]`` is page ``i``'s crc32 for kv head ``head_start + j``;
    ``error``: why the rank could not sum them (then ``sums`` is empty)."""

    id: int
    rank: int
    head_start: int
    head_end: int
    sums: list[list[int]] = field(default_factory=list)
    error: str = ""
    kind: str = KIND

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()


class RankSums(NamedTuple):
    """One rank's sums: ``sums[i][j]`` is page ``i``'s crc32 for kv head ``head_start + j``."""

    rank: int
    head_start: int
    head_end: int
    sums: list[list[int]]


def is_head_sums(payload: dict) -> bool:
    """Whether a decoded command or reply (JSON object) is a head-sum query / reply."""
    return payload.get("kind") == KIND


def heads_of(runner: ModelRunner) -> tuple[int, int]:
    """``[head_start, head_end)``: the global kv heads ``runner``'s pool holds."""
    if getattr(runner, "tp_shard", None) is not None:
        lo, hi = runner.tp_shard.kv_heads
        return int(lo), int(hi)
    return 0, int(runner.kv_pool.num_kv_heads)


def answer(query: dict, rank: int, runner: ModelRunner) -> HeadSumReply:
    """A follower's reply to a decoded ``HeadSumQuery`` (never raises: a malformed query or a page
    out of range is the reply's ``error``)."""
    lo, hi = heads_of(runner)
    try:
        return HeadSumReply(int(query["id"]), rank, lo, hi,
                            head_checksums(runner.kv_pool, [int(p) for p in query["pages"]]))
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        qid = query.get("id")
        return HeadSumReply(qid if isinstance(qid, int) else 0, rank, lo, hi, error=f"{type(e).__name__}: {e}")


_ids = itertools.count(1)  # query ids, one sequence per process


def every_rank_sums(runner: ModelRunner, pages: Sequence[int], timeout_s: float = 10.0) -> list[RankSums]:
    """Every rank's sums of ``pages`` (physical ids), rank order; one rank: rank 0's alone. Call
    from the thread that runs the forwards (the queries travel behind every batch sent before).

    Raises:
        TPRankDied: the group is dead or a follower's pipe is gone.
        TimeoutError: a follower did not answer within ``timeout_s`` seconds (naming its rank).
        ValueError: a follower's answer does not cover ``pages`` (naming its rank).
    """
    pages = [int(p) for p in pages]
    group = runner.tp
    asked: dict[int, int] = {}
    if group is not None:
        for rank in range(1, group.size):  # every follower computes while rank 0 does
            qid = next(_ids)
            group.send_command(rank, HeadSumQuery(qid, pages).encode())
            asked[rank] = qid
    lo, hi = heads_of(runner)
    out = [RankSums(0, lo, hi, head_checksums(runner.kv_pool, pages))]
    deadline = time.monotonic() + timeout_s
    for rank, qid in asked.items():
        got = await_reply(group.replies(rank), qid, deadline, rank, KIND)
        sums = got.get("sums")
        if got.get("error") or not isinstance(sums, list) or len(sums) != len(pages):
            raise ValueError(f"tensor-parallel rank {rank} could not sum the pages: "
                             f"{got.get('error') or f'{len(sums or [])} pages answered, {len(pages)} asked'}")
        out.append(RankSums(rank, int(got["head_start"]), int(got["head_end"]), sums))
    return out
