"""What a benchmark sends (:class:`BenchRequest`) and what it measured (:class:`RequestRecord`).

Both are plain dataclasses shared by the workloads, the two targets (router gRPC, OpenAI HTTP), the
load generator, the statistics and the evals. Times are ``time.perf_counter()`` seconds.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class BenchRequest:
    """One request to send.

    Exactly one input form is used: ``messages`` (chat; the server applies the model's chat
    template), else ``prompt_ids`` (token ids, int32 values; the router takes them as-is), else
    ``prompt`` (text). ``prompt`` is always filled for single-turn requests so that a target that
    only takes text (an OpenAI server) sends the same prompt.

    Attributes:
        prompt: prompt text (completions), or None for chat requests.
        prompt_ids: the prompt as token ids (``list[int]``), or None.
        messages: chat messages ``[{"role": str, "content": str}, ...]``, or None.
        max_tokens: output token budget (tokens).
        ignore_eos: keep generating past EOS (fixed output lengths for load tests).
        temperature: 0 = greedy.
        stop: stop strings.
        session_id: conversation id (multi-turn), else the request's own index.
        turn: turn index in the conversation (0 for single-turn).
        group: shared-prefix group id, or -1.
        tag: free-form label carried into the record (e.g. the eval question index).
        stop_after: when set, the client stops reading after this many output tokens and cancels the
            call (the server ends the request as an abort). With dummy weights, which never emit EOS,
            this stands in for a natural stop at a length the server cannot know in advance.
    """

    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    temperature: float = 0.0
    stop: list[str] = dataclasses.field(default_factory=list)
    session_id: int = 0
    turn: int = 0
    group: int = -1
    tag: Any = None
    stop_after: int | None = None


@dataclasses.dataclass
class RequestRecord:
    """What one request measured.

    ``chunk_times[i]`` (perf_counter seconds) is when the i-th streamed chunk that carried output
    arrived, and ``chunk_tokens[i]`` how many output tokens it carried (known exactly from the router's
    ``token_ids``; for an OpenAI stream each content chunk counts 1 until the final usage is known,
    see :func:`bench.stats.itl_gaps`). Usage fields are -1 when the server did not report them.
    """

    session_id: int = 0
    turn: int = 0
    group: int = -1
    tag: Any = None
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    chunk_tokens: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str = ""
    ok: bool = False
    error: str = ""
    prompt_tokens: int = -1
    completion_tokens: int = -1
    cached_tokens: int = -1
    decode_prefix_tokens: int = -1
    kv_pages_transferred: int = -1
    kv_bytes_transferred: int = -1
    prefill_worker: str = ""
    decode_worker: str = ""

    @property
    def ttft(self) -> float | None:
        """Seconds from send to the first chunk carrying output, or None when none came."""
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        """Seconds from send to the end of the stream."""
        return self.end - self.start

    @property
    def output_tokens(self) -> int:
        """Output tokens: the server's usage when reported, else the sum over chunks."""
        return self.completion_tokens if self.completion_tokens >= 0 else sum(self.chunk_tokens)

    def to_json(self, t0: float = 0.0) -> dict[str, Any]:
        """JSON-ready dict with times relative to ``t0`` (seconds)."""
        d = dataclasses.asdict(self)
        d["start"] = self.start - t0
        d["end"] = self.end - t0
        d["chunk_times"] = [round(t - t0, 6) for t in self.chunk_times]
        d["ttft"] = self.ttft
        d["e2e"] = self.e2e
        d["output_tokens"] = self.output_tokens
        return d
