"""Benchmark target: any OpenAI-compatible server (ours, vLLM, llama.cpp, ``transformers serve``).

Uses the official ``openai`` async client, streaming, with ``stream_options.include_usage`` so the
final chunk carries the server's token counts. ``/v1/completions`` for text prompts,
``/v1/chat/completions`` for chat messages. Chunk token counts are not exposed by the API: each chunk
with non-empty content counts as one token in the ITL statistics (servers such as vLLM send one token
per chunk); ``completion_tokens`` from the usage is used for TPOT and throughput when reported.

``ignore_eos`` is sent in ``extra_body`` (a vLLM / SGLang extension); ``cached_tokens`` is read
from ``usage.prompt_tokens_details`` and, like the halfmoon KV usage fields, from any extra keys the
server adds to ``usage``.
"""

from __future__ import annotations

import time
from typing import Any

import openai

from bench.request import BenchRequest, RequestRecord

_EXTRA_USAGE = ("decode_prefix_tokens", "kv_pages_transferred", "kv_bytes_transferred", "cached_tokens")


def _usage_into(rec: RequestRecord, usage: Any) -> None:
    rec.prompt_tokens = int(usage.prompt_tokens or 0)
    rec.completion_tokens = int(usage.completion_tokens or 0)
    details = getattr(usage, "prompt_tokens_details", None)
    if details is not None and getattr(details, "cached_tokens", None) is not None:
        rec.cached_tokens = int(details.cached_tokens)
    extra = getattr(usage, "model_extra", None) or {}
    for key in _EXTRA_USAGE:
        if extra.get(key) is not None:
            setattr(rec, key, int(extra[key]))


class OpenAITarget:
    """Streams requests to ``base_url`` (e.g. ``http://127.0.0.1:8000/v1``).

    Args:
        base_url: the server's ``/v1`` URL.
        model: model name; "" = the first one ``/v1/models`` lists.
        api_key: sent as the bearer token (most local servers ignore it).
        extra_body: extra JSON fields for every request (merged over ``ignore_eos``).
        timeout_s: per-request timeout (seconds).
    """

    name = "openai"

    def __init__(self, base_url: str, model: str = "", api_key: str = "EMPTY",
                 extra_body: dict[str, Any] | None = None, timeout_s: float = 600.0):
        self.base_url = base_url
        self.model = model
        self.api_key = api_key
        self.extra_body = dict(extra_body or {})
        self.timeout_s = timeout_s
        self._client: openai.AsyncOpenAI | None = None

    async def start(self) -> None:
        self._client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key,
                                          max_retries=0, timeout=self.timeout_s)
        if not self.model:
            try:
                self.model = await self.served_model()
            except openai.APIError as e:
                raise SystemExit(f"{self.base_url}/models failed ({e}); pass --model NAME") from e
            if not self.model:
                raise SystemExit(f"{self.base_url}/models lists no model; pass --model NAME")

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def served_model(self) -> str:
        assert self._client is not None, "start() first"
        models = await self._client.models.list()
        return models.data[0].id if models.data else ""

    async def generate(self, req: BenchRequest) -> RequestRecord:
        """Send ``req``, stream the answer, return what was measured (errors are recorded, not raised)."""
        assert self._client is not None, "start() first"
        rec = RequestRecord(session_id=req.session_id, turn=req.turn, group=req.group, tag=req.tag)
        body = {**({"ignore_eos": True} if req.ignore_eos else {}), **self.extra_body}
        common: dict[str, Any] = dict(model=self.model, max_tokens=req.max_tokens, temperature=req.temperature,
                                      stream=True, stream_options={"include_usage": True},
                                      extra_body=body or None)
        if req.stop:
            common["stop"] = list(req.stop)
        texts: list[str] = []
        rec.start = time.perf_counter()
        try:
            if req.messages is not None:
                stream = await self._client.chat.completions.create(messages=req.messages, **common)
            elif req.prompt is not None:
                stream = await self._client.completions.create(prompt=req.prompt, **common)
            else:
                raise ValueError("request has no messages or prompt (an OpenAI target sends text)")
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    _usage_into(rec, chunk.usage)
                for choice in chunk.choices:
                    piece = choice.delta.content if req.messages is not None else choice.text
                    if piece:
                        rec.chunk_times.append(now)
                        rec.chunk_tokens.append(1)
                        texts.append(piece)
                    if choice.finish_reason:
                        rec.finish_reason = choice.finish_reason
                if req.stop_after is not None and len(rec.chunk_tokens) >= req.stop_after \
                        and not rec.finish_reason:
                    await stream.close()  # closing the HTTP stream makes the server abort the request
                    rec.finish_reason = "client_stop"
                    break
            rec.ok = bool(rec.finish_reason)
            if not rec.ok:
                rec.error = "stream ended without a finish_reason"
        except openai.APIStatusError as e:
            rec.error = f"HTTP {e.status_code}: {str(e.body or e.message)[:300]}"
        except (openai.APIError, ValueError) as e:
            rec.error = f"{type(e).__name__}: {str(e)[:200]}"
        rec.end = time.perf_counter()
        rec.text = "".join(texts)
        return rec
