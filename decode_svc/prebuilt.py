"""The prebuilt first batch on D: which slots hold the transferred (delta) KV of a request.

D writes a request's ``req_to_token`` row as ``[prefix_locs (0..pre_len) | delta_locs
(pre_len..seq_len)]``, so the slots P's transfer filled — the prebuilt batch's ``out_cache_loc`` —
are ``req_to_token[row, pre_len : pre_len + extend_len]``. Reading ``[:extend_len]`` instead (an
easy slip, and SGLang's bug before #24230) names the *prefix* slots whenever ``pre_len > 0``: D
would then verify, and account for, the wrong pages.
"""

from __future__ import annotations

import torch

from engine.kvcache.paging import pages_of_slots


def prebuilt_out_cache_loc(req_to_token: torch.Tensor, row: int, pre_len: int,
                           extend_len: int) -> torch.Tensor:
    """Slots of the delta tokens of ``row``: int64 [extend_len], a copy.

    Args:
        req_to_token: int64 [rows, max_context].
        row: the request's row; pre_len: tokens D already held (page-aligned);
        extend_len: prompt tokens P computed for D (``prompt_len - pre_len``).
    Raises:
        ValueError: negative lengths or a range past the row's end.
    """
    if pre_len < 0 or extend_len < 0 or pre_len + extend_len > req_to_token.shape[1]:
        raise ValueError(f"bad delta range [{pre_len}, {pre_len + extend_len}) for a row of "
                         f"{req_to_token.shape[1]} slots")
    return req_to_token[row, pre_len: pre_len + extend_len].clone()


def delta_pages(out_cache_loc: torch.Tensor, page_size: int) -> list[int]:
    """Page ids of the delta (``out_cache_loc`` starts on a page boundary): one per page, in order."""
    return pages_of_slots(out_cache_loc, page_size)
