"""Memory policy shared by the schedulers that grow KV on demand: projection and victim choice.

A request is admitted for what it needs now (its prompt, plus a small decode reserve on the decode
worker) and grows a page at a time while it decodes. Admission therefore has to guess what the
requests already running will still take, or it would admit requests that must soon be undone.
The guess follows SGLang's ``new_token_ratio``: a request with ``remaining`` tokens left is
projected to still need ``ratio × min(remaining, clip)`` tokens. The ratio starts high, decays a
little every decode step (the longer nothing had to be undone, the more optimistic admission gets)
down to a floor, and jumps back to its start on every retraction. The clip bounds what one
request without a real ``max_tokens`` (a chat that may use "the rest of the context") is projected
to take.

When the pool still runs short at a decode step, a victim is retracted: its committed tokens'
full pages stay in the radix cache, everything else is freed, and it resumes later with prompt +
output as its prefix. The victim is the **newest** request that has not yet been retracted
``max_retractions`` times: the oldest requests keep going (FIFO fairness, what the co-located
scheduler always did), the newest has usually generated the least (the least work to recompute),
and a request retracted too often is pinned so it cannot starve. Only when every candidate is
pinned is the newest pinned one taken (progress beats the pin).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

INIT_RATIO = 0.7
FLOOR_RATIO = 0.1
DECAY_STEPS = 600          # decode steps from INIT_RATIO to FLOOR_RATIO
CLIP_TOKENS = 1024         # most tokens one request is projected to still generate
MAX_RETRACTIONS = 3        # retractions after which a request is pinned


@dataclass
class NewTokenRatio:
    """Fraction of a request's remaining tokens it is projected to still generate (0 < value <= 1).

    ``step()`` once per decode step (decays toward ``floor``); ``on_retract()`` when admission had
    to be undone (back to ``init``).
    """

    init: float = INIT_RATIO
    floor: float = FLOOR_RATIO
    decay_steps: int = DECAY_STEPS
    clip_tokens: int = CLIP_TOKENS
    value: float = -1.0

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.init <= 1:
            raise ValueError(f"need 0 < floor ({self.floor}) <= init ({self.init}) <= 1")
        if self.value < 0:
            self.value = self.init

    def step(self) -> None:
        self.value = max(self.floor, self.value - (self.init - self.floor) / max(1, self.decay_steps))

    def on_retract(self) -> None:
        self.value = self.init

    def projected_tokens(self, remaining: int) -> int:
        """Tokens a request with ``remaining`` tokens left (>= 0) is projected to still write."""
        return math.ceil(self.value * min(max(0, remaining), self.clip_tokens))


def pick_victim(candidates: Sequence[T], *, arrival: Callable[[T], int], retractions: Callable[[T], int],
                max_retractions: int = MAX_RETRACTIONS) -> tuple[T | None, str]:
    """Which request to retract, and why.

    Args:
        candidates: requests that may be retracted (the caller leaves out any whose pages a peer may
            still write).
        arrival: admission order (larger = newer); retractions: how often each was retracted.
        max_retractions: a request retracted this often is pinned (chosen only if all are).
    Returns:
        (victim, reason): reason "newest" (the newest unpinned), "pinned" (all were pinned: the
        newest of them), or (None, "") for no candidate.
    """
    if not candidates:
        return None, ""
    free = [c for c in candidates if retractions(c) < max_retractions]
    if free:
        return max(free, key=arrival), "newest"
    return max(candidates, key=arrival), "pinned"
