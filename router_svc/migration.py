"""Request migration: a stream whose decode worker fails (or drains) after tokens were sent goes on
on another pair (docs/architecture.md, A request's path: migration).

The router re-dispatches ``prompt + every token already sent`` with ``max_tokens`` reduced by those
tokens, on a new room, avoiding the failed decode worker; P's radix cache holds the prompt, so only
the generated tail is computed again. The client's stream continues from the exact next token: the
router keeps its one detokenizer (UTF-8 state, stop strings across the seam), counts every token
once, and ``prompt_tokens`` stays the client's prompt. At most ``--migration-limit`` times per
request (Dynamo's ``--migration-limit``); beyond it the stream ends with UNAVAILABLE naming the flag.

What continues exactly: greedy output (identical to an uninterrupted run), stop strings and stop
token ids, ``max_tokens``, ``repetition_penalty`` (it counts prompt + output, and the seam's tokens
are in the new prompt), ``logit_bias``, logprobs (each token's own). Seeded sampling continues
*reproducibly* (the new pair seeds its generator with the same seed at the seam) but not with the
tokens an uninterrupted run would have drawn: a generator's state does not cross processes.
Not migrated (the stream ends with UNAVAILABLE saying why): structured outputs / ``tool_choice``
grammars (a new worker's matcher would start from the grammar's root, not from the tokens already
sent) and ``frequency_penalty`` / ``presence_penalty`` (they count output tokens only, which the
new pair would see as prompt).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grpc

from pd_common.drain import MIGRATE_DRAIN, MIGRATE_KEY
from protos import common_pb2, decode_pb2, prefill_pb2, router_pb2
from router_svc.validation import PreparedRequest

# D errors after the first token that a new pair would only repeat
_NOT_MIGRATED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                 grpc.StatusCode.RESOURCE_EXHAUSTED)


def migrate_reason(exc: BaseException | None) -> str:
    """``"drain"`` when a worker's status asked for migration (trailing ``halfmoon-migrate``), else
    ``"failure"`` (a crash, a broken stream, an error)."""
    trailing = getattr(exc, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == MIGRATE_KEY:
            return MIGRATE_DRAIN if value == MIGRATE_DRAIN else "failure"
    return "failure"


class StreamState:
    """What the router has sent of one client request, across every pair that served it.

    Args:
        prep: the client's validated request.
        limit: migrations allowed (``--migration-limit``; 0 = none).
        retries: pairs re-picked before the first token (``Usage.retries``).
    """

    def __init__(self, prep: PreparedRequest, limit: int, retries: int = 0) -> None:
        self.prep = prep
        self.limit = limit
        self.generated: list[int] = []
        self.migrations = 0
        self.usage = router_pb2.Usage(prompt_tokens=len(prep.input_ids), retries=retries)
        self._leg = router_pb2.Usage()  # the current pair's numbers, as its D reports them
        self._pages = 0                 # KV pages / bytes moved by earlier pairs
        self._bytes = 0

    @property
    def n_tokens(self) -> int:
        return len(self.generated)

    def add(self, chunk: decode_pb2.DecodeChunk, token_ids: Sequence[int] | None = None) -> None:
        """Count one chunk of the current pair (D sets its accounting fields on the first and the
        last chunk; the non-zero ones are kept); ``token_ids``: the chunk's tokens the client gets
        (fewer when the router cut it at a stop string), default all of them."""
        self.generated.extend(chunk.token_ids if token_ids is None else token_ids)
        for f in ("cached_tokens", "decode_prefix_tokens", "kv_pages_transferred", "kv_bytes_transferred"):
            if getattr(chunk, f):
                setattr(self._leg, f, getattr(chunk, f))

    def refusal(self, code: grpc.StatusCode) -> str:
        """Why this stream cannot move after its D failed with ``code`` ("" when it can)."""
        s = self.prep.sampling
        if code in _NOT_MIGRATED:
            return f"not migrated: {code.name} would repeat on another pair"
        if self.migrations >= self.limit:
            return (f"not migrated: --migration-limit {self.limit} reached "
                    f"(migrated {self.migrations} time{'s' if self.migrations != 1 else ''})")
        if s.HasField("structured"):
            return "not migrated: a structured output's grammar state cannot move to another pair"
        if s.frequency_penalty or s.presence_penalty:
            return ("not migrated: frequency_penalty / presence_penalty count output tokens, which "
                    "another pair would see as prompt")
        return ""

    def continuation(self) -> PreparedRequest:
        """The request a new pair runs: prompt + the tokens sent, ``max_tokens`` minus them.
        Call only while tokens remain (``n_tokens < max_tokens``)."""
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(self.prep.sampling)
        sampling.max_tokens = self.prep.sampling.max_tokens - self.n_tokens
        return dataclasses.replace(self.prep, input_ids=list(self.prep.input_ids) + self.generated,
                                   sampling=sampling)

    def seam(self, p_result: prefill_pb2.PrefillResult | None) -> None:
        """The current pair is left behind: keep what it moved, and the client prompt's cache hits
        when it was the first."""
        self._fold(p_result)
        self._pages += self._leg.kv_pages_transferred
        self._bytes += self._leg.kv_bytes_transferred
        self._leg = router_pb2.Usage()
        self.migrations += 1

    def finish(self, p_result: prefill_pb2.PrefillResult | None) -> router_pb2.Usage:
        """Usage of the whole stream: every token once, the client's prompt, KV moved by every pair."""
        self._fold(p_result)
        u = self.usage
        u.completion_tokens = self.n_tokens
        u.kv_pages_transferred = self._pages + self._leg.kv_pages_transferred
        u.kv_bytes_transferred = self._bytes + self._leg.kv_bytes_transferred
        u.migrations = self.migrations
        u.cached_tokens = max(0, min(u.cached_tokens, u.prompt_tokens))
        return u

    def _fold(self, r: prefill_pb2.PrefillResult | None) -> None:
        leg = self._leg
        if r is not None:  # P's own numbers, when D did not forward them
            leg.cached_tokens = leg.cached_tokens or r.cached_tokens
            leg.kv_pages_transferred = leg.kv_pages_transferred or r.pages_sent
            leg.kv_bytes_transferred = leg.kv_bytes_transferred or r.bytes_sent
        if self.migrations == 0:  # later pairs' hits are on prompt + output, not the client's prompt
            self.usage.cached_tokens = leg.cached_tokens
            self.usage.decode_prefix_tokens = leg.decode_prefix_tokens
