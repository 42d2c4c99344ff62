"""The next prompt chunks of several requests under a token budget, as one EXTEND batch.

Chunked prefill on P (``prefill_svc.chunked_prefill``), D's own prefill of a request with no
prefill leg (``decode_svc.local_prefill``) and D's recompute of a resumed request
(``decode_svc.memory``) all compute part of a prompt per iteration: each request in order takes
its next tokens until the budget is spent, and the batch writes them into the slots its row
already holds (``req_to_token[row, start : start + len(chunk)]``, the pages were allocated at
admission). How far a request got is the caller's field (P's ``computed``, D's ``kv_len``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.forward_batch import ForwardBatch, ForwardMode


def next_chunks(prompts: Sequence[Sequence[int]], starts: Sequence[int], budget: int) -> list[Sequence[int]]:
    """The next tokens of each prompt, in order, until ``budget`` tokens are taken.

    Args:
        prompts: each request's prompt token ids.
        starts: per request, how many of its prompt tokens are computed already (same length).
        budget: most tokens in all (the chunk budget, ``--chunked-prefill-size``).

    Returns:
        ``prompts[i][starts[i] : starts[i] + take_i]`` for the first requests, one entry per
        request taken (a prefix of ``prompts``): the last one taken may get only part of its
        rest; none is taken once the budget is spent. Empty when ``budget`` <= 0.
    """
    chunks: list[Sequence[int]] = []
    for prompt, start in zip(prompts, starts):
        if budget <= 0:
            break
        take = min(len(prompt) - start, budget)
        chunks.append(prompt[start: start + take])
        budget -= take
    return chunks


def extend_batch(req_to_token: torch.Tensor, rows: Sequence[int], starts: Sequence[int],
                 chunks: Sequence[Sequence[int]], device: str | torch.device) -> ForwardBatch:
    """One EXTEND batch of ``chunks[i]`` at positions ``starts[i]..`` of request row ``rows[i]``.

    ``out_cache_loc`` is the rows' own slots: ``req_to_token[rows[i], starts[i] : starts[i] +
    len(chunks[i])]`` concatenated (int64 slot ids, one per token). ``req_to_token`` is the
    ``ReqToTokenPool.req_to_token`` table ([rows, max_context] int). Raises ValueError as
    :meth:`ForwardBatch.build` (lengths disagree, an empty chunk) or when ``chunks`` is empty.
    """
    if not chunks:
        raise ValueError("an EXTEND batch needs at least one request")
    loc = torch.cat([req_to_token[row, start: start + len(c)] for row, start, c in zip(rows, starts, chunks)])
    return ForwardBatch.build(ForwardMode.EXTEND, list(rows), list(starts), chunks, loc, device)
