"""Page-hash chain: stable 64-bit keys for page-aligned token prefixes.

Prefill, decode and the router must agree on which prefixes they hold, across processes and
restarts, so keys never use Python's salted ``hash()``. Page ``i`` of a sequence is keyed by

    h_i = blake2b(h_{i-1} (8 bytes, little-endian) || tokens[i*ps:(i+1)*ps] (int64 LE each),
                  digest_size=8)  read as an unsigned little-endian 64-bit int,

with ``h_{-1} = seed`` (default ``ROOT_HASH = 0``; pass e.g. a model-specific seed to keep caches of
different models apart). Chaining makes ``h_i`` identify the whole prefix ``tokens[: (i+1)*ps]``, not
just page ``i``, the same idea as vLLM's block hashes and SGLang's KV events. A partial last page
has no hash (it is never shared).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0
_MAX_U64 = (1 << 64) - 1


def page_hash(parent: int, page_tokens: Sequence[int]) -> int:
    """Hash of one page given its parent's hash.

    Args:
        parent: hash of the previous page (or the seed for page 0), an int in [0, 2**64).
        page_tokens: the page's token ids (ints in [0, 2**63)); any length >= 1.
    Returns:
        Unsigned 64-bit int.
    Raises:
        ValueError: parent out of range, empty page, or a token id outside [0, 2**63).
    """
    if not 0 <= parent <= _MAX_U64:
        raise ValueError(f"parent hash {parent} is not an unsigned 64-bit int")
    if len(page_tokens) == 0:
        raise ValueError("page_tokens is empty")
    try:
        body = struct.pack(f"<Q{len(page_tokens)}q", parent, *page_tokens)
    except struct.error as e:
        raise ValueError(f"token ids must be ints in [0, 2**63): {e}") from None
    if min(page_tokens) < 0:
        raise ValueError("token ids must be non-negative")
    return int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "little")


def page_hashes(tokens: Sequence[int], page_size: int, seed: int = ROOT_HASH) -> list[int]:
    """Chained hashes of every full page of ``tokens``.

    Args:
        tokens: token ids (list/tuple of ints, or anything indexable to ints; a torch/numpy 1-D
            integer array works after ``.tolist()``).
        page_size: tokens per page (>= 1).
        seed: hash of the (virtual) page before page 0.
    Returns:
        ``len(tokens) // page_size`` unsigned 64-bit ints; element i keys ``tokens[: (i+1)*page_size]``.
    Raises:
        ValueError: page_size < 1 or bad token ids (see ``page_hash``).
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    tokens = list(tokens)
    out: list[int] = []
    h = seed
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = page_hash(h, tokens[start:start + page_size])
        out.append(h)
    return out
