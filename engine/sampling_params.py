"""SamplingParams: per-request decoding knobs, validated before anything is allocated.

Semantics (OpenAI / vLLM / HF conventions):
- ``temperature == 0`` is greedy (argmax); otherwise logits are divided by it.
- ``top_k`` <= 0 disables it (-1 is the conventional "off"); ``top_p`` in (0, 1]; ``min_p`` in [0, 1].
- ``repetition_penalty`` (HF, > 0; 1 = off) scales logits of tokens seen in prompt or output;
  ``frequency_penalty`` / ``presence_penalty`` (OpenAI, in [-2, 2]) subtract ``f * count`` /
  ``p * (count > 0)`` over generated tokens.
- ``stop`` strings end the output and are not returned; ``stop_token_ids`` end it (the token is
  generated but its text is not returned); EOS ends it unless ``ignore_eos``.
- ``logprobs``: return the log-probability of each chosen token under the model's raw distribution
  (log_softmax of unprocessed logits), and ``top_logprobs`` (0..20) alternatives.
- ``seed``: a per-request ``torch.Generator``; same seed, same prompt -> same tokens.
- ``logit_bias``: token id -> bias in [-100, 100] added to the raw logits before anything else
  (OpenAI: -100 bans a token, +100 all but forces it); logprobs stay those of the raw logits.
- ``structured``: a grammar (engine/grammar.py) the output must match; tokens it forbids are
  masked before sampling, and a complete output ends with EOS.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from engine.errors import InvalidRequestError
from engine.grammar import GrammarSpec

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: |bias| <= 100
SEED_MOD = 2**64


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed``: ``(seed + index) mod 2**64``,
    so seeded sample i of an ``n > 1`` request equals an ``n = 1`` request with seed ``seed + i``."""
    return (seed + index) % SEED_MOD


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    structured: GrammarSpec | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, vocab_size: int, max_context: int, prompt_len: int) -> None:
        """Raise :class:`InvalidRequestError` naming the first bad field; returns None when valid."""

        def bad(field, msg):
            raise InvalidRequestError(field, msg)

        if prompt_len < 1:
            bad("prompt", "empty prompt (at least one token is needed)")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if prompt_len + self.max_tokens > max_context:
            bad("max_tokens", f"prompt ({prompt_len} tokens) + max_tokens ({self.max_tokens}) exceeds the "
                              f"context window of {max_context} tokens")
        if not self.temperature >= 0:  # also catches NaN
            bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1/0 (off) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", f"must be a non-negative integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"token ids must be in [0, {vocab_size})")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            bad("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        for t, b in self.logit_bias.items():
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                bad("logit_bias", f"token id {t!r} is outside [0, {vocab_size})")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) \
                    or abs(b) > MAX_LOGIT_BIAS:
                bad("logit_bias", f"bias of token {t} must be a finite number in [-100, 100], got {b!r}")


def validate_prompt_ids(token_ids: Sequence[int], vocab_size: int, field: str = "prompt") -> None:
    """Raise InvalidRequestError(field) for an empty prompt or a token id outside ``[0, vocab_size)``."""
    if len(token_ids) == 0:
        raise InvalidRequestError(field, "empty prompt (at least one token is needed)")
    for i, t in enumerate(token_ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidRequestError(field, f"token {i} = {t!r} is outside the vocabulary [0, {vocab_size})")


def for_sample(params: SamplingParams, index: int) -> SamplingParams:
    """``params`` of sample ``index`` (a copy with the derived seed; ``params`` itself when unseeded
    or ``index == 0``)."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=sample_seed(params.seed, index))
