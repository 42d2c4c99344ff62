"""A :class:`~engine.forward_batch.ForwardBatch` as one int64 tensor, for rank 0 to broadcast to
the other tensor-parallel ranks.

Rank 0's scheduler writes ``req_to_token`` outside the forward, so the message also carries each
request's row ``[0, seq_len)``: a follower writes those rows into its own table before the forward
and its attention reads the same slots (its KV pool has the same pages, with its kv heads).

With CUDA graphs on, rank 0 decides per decode step whether to replay a captured graph and of
which bucket; the decision travels in the header (``G``: the bucket, 0 for eager), so every rank
replays the same graph (each pads to bucket ``G`` with its own scratch page, the same page index on
every rank) or every rank runs eagerly: the ranks' collectives always match.

Layout (int64)::

    [mode, B, T, L, G] rows[B] seq_lens[B] prefix_lens[B] extend_lens[B]
    input_ids[T] positions[T] out_cache_loc[T] logit_index[L] row_slots[sum(seq_lens)]

``L = -1`` means no ``logit_index`` (each request's last token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch, ForwardMode

HEADER = 5
_MODES = (ForwardMode.EXTEND, ForwardMode.DECODE)


@dataclass(frozen=True)
class WireBatch:
    """One forward as a follower receives it.

    ``graph_bucket``: the CUDA-graph bucket rank 0 replays for this decode batch (pad to it and
    replay the same graph), or 0: run ``runner.model`` eagerly (with ``logit_index``, int64 [L] or
    None for each request's last token)."""

    batch: ForwardBatch
    logit_index: torch.Tensor | None
    graph_bucket: int = 0


def pack_batch(batch: ForwardBatch, logit_index: torch.Tensor | None, req_to_token: torch.Tensor,
               graph_bucket: int = 0) -> torch.Tensor:
    """The message for ``batch`` (int64 [N] on ``req_to_token``'s device). ``graph_bucket`` > 0 says
    every rank replays that bucket's CUDA graph (a decode batch of at most that many requests, no
    ``logit_index``). Raises ValueError for a graph decision that cannot hold."""
    if graph_bucket and (batch.mode is not ForwardMode.DECODE or logit_index is not None
                         or batch.batch_size > graph_bucket):
        raise ValueError(f"graph bucket {graph_bucket} for a {batch.mode.name} batch of {batch.batch_size}"
                         f"{' with a logit_index' if logit_index is not None else ''}")
    dev = req_to_token.device
    seq_cpu, _ = batch.host_lens()
    rows = batch.req_pool_indices.to(dev)
    # one gather from host-known lengths: the rows stay on the device, so on CUDA packing does not
    # wait for the previous step (the overlap schedule launches a step before reading the last one)
    total = int(seq_cpu.sum())
    starts = torch.cumsum(seq_cpu, 0) - seq_cpu
    cols = torch.arange(total) - torch.repeat_interleave(starts, seq_cpu, output_size=total)
    at_rows = torch.repeat_interleave(rows, seq_cpu.to(dev, non_blocking=True), output_size=total)
    slots = [req_to_token[at_rows, cols.to(dev, non_blocking=True)]]
    L = -1 if logit_index is None else logit_index.numel()
    head = torch.tensor([_MODES.index(batch.mode), batch.batch_size, batch.input_ids.numel(), L, graph_bucket],
                        dtype=torch.int64, device=dev)
    parts = [head, rows, batch.seq_lens, batch.prefix_lens, batch.extend_lens, batch.input_ids,
             batch.positions, batch.out_cache_loc]
    if logit_index is not None:
        parts.append(logit_index)
    return torch.cat([p.to(dev, torch.int64).reshape(-1) for p in parts + slots])


def unpack_batch(msg: torch.Tensor, req_to_token: torch.Tensor) -> WireBatch:
    """The forward of a message; writes the carried rows into ``req_to_token``.

    Raises ValueError for a message whose lengths do not add up (a bug on rank 0, never input).
    """
    mode, B, T, L, G = msg[:HEADER].tolist()
    off = HEADER

    def take(n: int) -> torch.Tensor:
        nonlocal off
        part = msg[off: off + n]
        off += n
        return part

    rows, seq, pre, ext = take(B), take(B), take(B), take(B)
    ids, pos, loc = take(T), take(T), take(T)
    logit_index = take(L) if L >= 0 else None
    seq_cpu = seq.cpu()
    for r, s in zip(rows.tolist(), seq_cpu.tolist()):
        req_to_token[r, :s] = take(s)
    if off != msg.numel():
        raise ValueError(f"batch message of {msg.numel()} int64s, expected {off}")
    batch = ForwardBatch(mode=_MODES[mode], input_ids=ids, positions=pos, req_pool_indices=rows, seq_lens=seq,
                         prefix_lens=pre, extend_lens=ext, out_cache_loc=loc, seq_lens_cpu=seq_cpu,
                         extend_lens_cpu=ext.cpu())
    return WireBatch(batch, logit_index, G)
