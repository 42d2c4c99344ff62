"""D's side of head-blocked writes: rewriting delta pages token-major before anything reads them.

When P and D split the kv heads differently, P writes each page of a D rank whose heads P's ranks
cut as contiguous blocks, one per cut-off head range, in head order (``pd_common.head_slices``):
page ``[block_0 | block_1 | ...]`` with block ``[lo, hi)`` shaped ``[layers, K/V, page_size, hi - lo,
head_dim]``. The pool's layout is ``[layers, K/V, page_size, heads, head_dim]`` per page, so D rank s
rewrites (unblocks) those pages in place before the room is committed.

P's notice carries the cuts (``KVNotice.head_block_cuts``: sorted kv-head boundaries of its writes,
``[0, ..., kv_heads]``; empty when no D page is blocked). On the notice D rank 0 unblocks its own
pages inline and sends each other affected rank an ``UnblockCommand`` on the TP command pipe
(``HeadUnblocker``). No reply is needed: a follower handles the pipe in order, so every later
forward announced on it (the only thing on that rank that reads those pages) runs after the
unblock; P's notice came after every rank's puts completed, so the bytes are in place when the
command is sent; and each rank's attention reads only its own pool.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

KIND = "unblock"  # the "kind" of the command on the TP command pipe
# pages per copy on CPU: a few pages' temporaries stay in cache (512 SmolLM2 pages of 3 heads on the
# 2-core box: 62 ms at 4 pages a chunk, 131 ms at 16, ~450 ms at 64); on CUDA, fewer launches
_CHUNK_PAGES = {"cpu": 4, "cuda": 64}


def rank_blocks(cuts: Sequence[int], head_start: int, head_end: int) -> list[tuple[int, int]]:
    """The blocks ``[lo, hi)`` in head order of a rank holding heads ``[head_start, head_end)``, cut at
    ``cuts`` (one block: the page is token-major already)."""
    inner = [int(c) for c in cuts if head_start < int(c) < head_end]
    bounds = [head_start, *inner, head_end]
    return list(zip(bounds[:-1], bounds[1:]))


def check_cuts(cuts: Sequence[int], kv_heads: int) -> str | None:
    """Why ``cuts`` (from a notice) are malformed for a pool of ``kv_heads`` heads, or None. Empty is
    fine (nothing blocked)."""
    c = [int(x) for x in cuts]
    if not c:
        return None
    if c[0] != 0 or c[-1] != kv_heads or any(a >= b for a, b in zip(c, c[1:])):
        return f"head block cuts {c} are not increasing from 0 to {kv_heads} kv heads"
    return None


def unblock_pages(region: torch.Tensor, pages: Sequence[int], blocks: Sequence[Sequence[int]]) -> None:
    """Rewrite ``pages`` of ``region`` (a page_major pool ``[pages, layers, 2, page_size, heads,
    head_dim]``, any dtype and device) from head-blocked (``blocks``: ``[lo, hi)`` pairs in head
    order, relative or absolute, covering the rank's heads) to token-major, in place.

    Raises:
        ValueError: the blocks do not cover the pool's heads, or a page is out of range.
    """
    if len(blocks) <= 1 or not len(pages):
        return
    n_pages, layers, two, ps, heads, hd = region.shape
    sizes = [int(hi) - int(lo) for lo, hi in blocks]
    if sum(sizes) != heads or min(sizes) < 1:
        raise ValueError(f"head blocks {list(blocks)} do not cover a pool of {heads} kv heads")
    idx_all = torch.as_tensor([int(p) for p in pages], dtype=torch.int64)
    if int(idx_all.min()) < 0 or int(idx_all.max()) >= n_pages:
        raise ValueError(f"page outside a pool of {n_pages} pages")
    idx_all = idx_all.to(region.device)
    with torch.inference_mode():
        _unblock(region, idx_all, sizes)


def _unblock(region: torch.Tensor, idx_all: torch.Tensor, sizes: list[int]) -> None:
    _, layers, two, ps, heads, hd = region.shape
    chunk = _CHUNK_PAGES.get(region.device.type, 4)
    out = torch.empty((chunk, layers, two, ps, heads, hd), dtype=region.dtype, device=region.device)
    for i in range(0, len(idx_all), chunk):
        idx = idx_all[i:i + chunk]
        n = len(idx)
        flat = region.index_select(0, idx).view(n, -1)  # a copy: the blocked bytes
        off = h0 = 0
        for h in sizes:
            size = layers * two * ps * h * hd
            out[:n, :, :, :, h0:h0 + h].copy_(flat[:, off:off + size].view(n, layers, two, ps, h, hd))
            off, h0 = off + size, h0 + h
        region.index_copy_(0, idx, out[:n])


@dataclass
class UnblockCommand:
    """Rank 0 -> follower: unblock ``pages`` of your pool, blocked at ``blocks`` (``[lo, hi)`` pairs)."""

    pages: list[int]
    blocks: list[list[int]]
    kind: str = KIND

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()


def is_unblock(payload: dict) -> bool:
    """Whether a decoded command (JSON object) is an ``UnblockCommand``."""
    return payload.get("kind") == KIND


class HeadUnblocker:
    """D rank 0's step between P's notice and the commit: every rank's blocked delta pages rewritten
    token-major (see the module docstring). Call from the thread that runs the forwards.

    Args:
        region: rank 0's page_major pool (``KVPool.region``; None for layer_major, which never
            receives per-rank writes). rank_heads: every rank's kv heads ``(start, end)``, rank
            order. group: D's ``TPGroup`` (None: one rank). kv_heads: the model's kv heads.
    """

    def __init__(self, region: torch.Tensor | None, rank_heads: Sequence[tuple[int, int]], group,
                 kv_heads: int):
        self.region, self.rank_heads, self.group, self.kv_heads = region, list(rank_heads), group, kv_heads

    @classmethod
    def for_runner(cls, runner) -> "HeadUnblocker":
        from engine.distributed.shard import plan_shard

        tp = runner.tp
        heads = [plan_shard(runner.model_config, r, tp.size).kv_heads for r in range(tp.size)] if tp \
            else [(0, runner.model_config.num_kv_heads)]
        return cls(runner.kv_pool.region, heads, tp, runner.model_config.num_kv_heads)

    def unblock(self, pages: Sequence[int], cuts: Sequence[int]) -> str:
        """Unblock ``pages`` (D's delta pages of one room) on every rank ``cuts`` split -> "" or what
        is wrong with ``cuts`` (nothing was changed then).

        Raises:
            TPRankDied: a follower's pipe is gone (the worker is going down).
        """
        why = check_cuts(cuts, self.kv_heads)
        if why or not cuts or not len(pages):
            return why or ""
        if self.region is None:
            return "head-blocked pages need the page_major KV layout"
        pages = [int(p) for p in pages]
        for rank, (lo, hi) in enumerate(self.rank_heads):
            blocks = rank_blocks(cuts, lo, hi)
            if len(blocks) <= 1:
                continue
            if rank == 0:
                unblock_pages(self.region, pages, blocks)
            else:
                self.group.send_command(rank, UnblockCommand(pages, [list(b) for b in blocks]).encode())
        return ""


COPY_KIND = "copy_pages"  # D's fork: the "kind" of a page copy on the TP command pipe


@dataclass
class CopyPagesCommand:
    """Rank 0 -> follower: copy pages ``src`` of your pool into ``dst`` (``KVPool.copy_pages``): a
    forked request's partial last page (decode_svc/fork.py). No reply: the pipe's order puts it
    before any forward that reads ``dst``."""

    src: list[int]
    dst: list[int]
    kind: str = COPY_KIND

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()


def is_copy_pages(payload: dict) -> bool:
    """Whether a decoded command (JSON object) is a ``CopyPagesCommand``."""
    return payload.get("kind") == COPY_KIND


def copy_pages_on_ranks(pool, group, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy pages ``src`` into ``dst`` in rank 0's ``pool`` and, under TP (``group``), in every
    follower's: each rank holds only its own kv heads of a page. Call from the thread that runs the
    forwards.

    Raises:
        TPRankDied: a follower's pipe is gone (the worker is going down).
    """
    pool.copy_pages(src, dst)
    if group is None or group.size <= 1:
        return
    cmd = CopyPagesCommand([int(p) for p in src.tolist()], [int(p) for p in dst.tolist()]).encode()
    for rank in range(1, group.size):
        group.send_command(rank, cmd)
