"""Req: one request's state inside the co-located scheduler.

Token bookkeeping: ``all_ids = prompt_ids + output_ids``; ``kv_len`` tokens of it have K/V in the
pool. While admitted, ``lease`` (``engine.kvcache.cache_manager.KVLease``) holds its row: slots
``[0, lease.alloc_len)`` are allocated (``kv_len <= alloc_len``) and ``[0, lease.pre_len)`` are the
radix-cache prefix it locked. The pending tokens ``all_ids[kv_len:]`` are what the next forward
computes (a prompt chunk, or the one last sampled token in decode).
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from engine.grammar import GrammarState
from engine.kvcache.cache_manager import KVLease
from engine.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"


@dataclasses.dataclass(eq=False)
class Req:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    grammar: GrammarState | None = None  # structured output: the matcher over output_ids
    output_ids: list[int] = dataclasses.field(default_factory=list)
    lease: KVLease | None = None
    kv_len: int = 0
    cached_tokens: int | None = None  # prompt tokens served from the radix cache (first admission)
    finish_reason: FinishReason | None = None
    stop_str: str | None = None
    arrival: int = 0  # admission order (FIFO and preemption pick the newest)
    preemptions: int = 0
    error: str | None = None  # set when the engine failed the request (RESOURCE_EXHAUSTED-like)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        """Tokens whose K/V the next forwards must compute before a token can be sampled."""
        return self.seq_len - self.kv_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
