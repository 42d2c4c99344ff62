"""Memory policy shared by the schedulers that grow KV on demand: projection and victim choice.

A request is admitted for what it needs now (its prompt, plus a small decode reserve on the decode
worker) and grows a page at a time while it decodes. Admission therefore has to guess what the
requests already running will still take, or it would admit requests that must soon be undone.
The guess follows SGLang's ``new_token_ratio``: a request with ``remaining`` tokens left is
projected to still need ``ratio × min(remaining, clip)`` tokens. The clip bounds what one request
without a real ``max_tokens`` (a chat that may use "the rest of the context") is projected to take.

SGLang's ratio starts at ``init_new_token_ratio``, decays by a fixed amount every decode step down
to ``min_new_token_ratio``, and on a retraction is reset from the retracted batch's progress. It
never looks at how requests actually end. Here the ratio also **learns from finishes**: every
request that ends by itself (stop, EOS, max_tokens, context) contributes
``generated / min(max_tokens, clip)`` to an exponential moving average, and the decay stops at that
average (bounded by the floor and the initial ratio) instead of at the floor. A workload of chats
that stop after a few dozen of their thousands of allowed tokens therefore settles near the floor
(admission packs the pool), while one whose requests run to ``max_tokens`` stays at the initial
ratio (admission stays close to the whole remaining length). A retraction still resets the ratio
to its initial value: admission was too optimistic, whatever the finishes said.

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
EMA_WEIGHT = 0.1           # weight of one finished request in the learned ratio


@dataclass
class NewTokenRatio:
    """Fraction of a request's remaining tokens it is projected to still generate (0 < value <= 1).

    ``step()`` once per decode step (decays toward ``target``); ``on_finish()`` when a request ended
    by itself (moves ``learned``); ``on_retract()`` when admission had to be undone (back to
    ``init``). ``target`` = ``learned`` bounded to ``[floor, init]`` (``floor`` before any finish).
    """

    init: float = INIT_RATIO
    floor: float = FLOOR_RATIO
    decay_steps: int = DECAY_STEPS
    clip_tokens: int = CLIP_TOKENS
    ema_weight: float = EMA_WEIGHT
    value: float = -1.0
    learned: float | None = None  # EMA of generated / min(max_tokens, clip) over finished requests

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.init <= 1:
            raise ValueError(f"need 0 < floor ({self.floor}) <= init ({self.init}) <= 1")
        if not 0 < self.ema_weight <= 1:
            raise ValueError(f"ema_weight must be in (0, 1], got {self.ema_weight}")
        if self.value < 0:
            self.value = self.init

    @property
    def target(self) -> float:
        """Where the decay stops: what finishes showed, bounded by the floor and the initial ratio."""
        if self.learned is None:
            return self.floor
        return min(self.init, max(self.floor, self.learned))

    def step(self) -> None:
        # never below the target; a target that rose above the value (longer finishes) lifts it
        self.value = max(self.target, self.value - (self.init - self.floor) / max(1, self.decay_steps))

    def on_finish(self, generated: int, max_tokens: int) -> float:
        """A request ended by itself after ``generated`` of its ``max_tokens`` (both >= 1) tokens;
        returns the share it used, ``generated / min(max_tokens, clip)`` capped at 1."""
        seen = min(1.0, generated / max(1, min(max_tokens, self.clip_tokens)))
        self.learned = seen if self.learned is None else (
            (1 - self.ema_weight) * self.learned + self.ema_weight * seen)
        self.value = max(self.value, self.target)
        return seen

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
