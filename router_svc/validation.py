"""Request validation before dispatch: every bad input becomes INVALID_ARGUMENT naming the field.

Nothing is allocated on any worker before a request passes here (docs/architecture.md, Invariants:
bad input gets a clear status before anything is allocated).
Ranges follow OpenAI / vLLM semantics (protos/common.proto documents each sampling field).
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.sampling_params import MAX_LOGIT_BIAS
from pd_common.protocol import structured_from_proto
from protos import common_pb2, router_pb2
from router_svc.api_keys import ANONYMOUS
from router_svc.errors import RouterError
from router_svc.tokenizer import RouterTokenizer

MAX_TOP_LOGPROBS = 20
DEFAULT_MAX_TOKENS = 16  # protos/common.proto: SamplingParams.max_tokens default
MAX_SAMPLES = 16  # n and best_of: each sample is one PD request (router_svc/fanout.py)


@dataclass
class PreparedRequest:
    """A validated request, ready for the PD legs.

    Attributes:
        request_id: client id or a fresh ``"req-<hex>"``.
        input_ids: prompt token ids, ``1 <= len <= max_context - max_tokens``.
        sampling: copy of the request's sampling with ``max_tokens`` always set.
        stop: stop strings (removed from returned text).
        tenant: the caller's tenant (API key); request ids are scoped per tenant.
        n: samples returned, ``1 <= n <= best_of``.
        best_of: samples generated, ``<= MAX_SAMPLES`` (the n best by cumulative logprob are returned).
    """

    request_id: str
    input_ids: list[int]
    sampling: common_pb2.SamplingParams
    stop: list[str]
    tenant: str = ANONYMOUS
    n: int = 1
    best_of: int = 1

    @property
    def worker_request_id(self) -> str:
        """The id workers see: ``<tenant>/<request_id>``, unique across tenants (a tenant name has no
        ``/``); the client's id as it is when the router is open (one tenant)."""
        return self.request_id if self.tenant == ANONYMOUS else f"{self.tenant}/{self.request_id}"


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise RouterError.invalid(name, f"must be a finite number, got {value}")
    return value


def _json_list(text: str, field: str, what: str) -> list:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise RouterError.invalid(field, f"{what} is not JSON: {exc}") from exc
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise RouterError.invalid(field, f"{what} must be a JSON array of objects")
    return value


def _template_calls(calls: list[dict]) -> list[dict]:
    """OpenAI tool calls (arguments as JSON text) as chat templates take them (arguments an object,
    as vLLM passes them), so a template's ``tojson`` does not encode them twice."""
    out = []
    for c in calls:
        fn = dict(c.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass  # not JSON: the template gets the text as sent
        out.append(dict(c, function=fn))
    return out


def validate_sampling(s: common_pb2.SamplingParams, vocab_size: int, tok: RouterTokenizer | None = None) -> None:
    """Check every sampling field's range (and, given ``tok``, compile ``structured``).

    Raises:
        RouterError: INVALID_ARGUMENT with ``param`` set to the offending field.
    """
    if s.HasField("temperature") and _finite("temperature", s.temperature) < 0:
        raise RouterError.invalid("temperature", f"must be >= 0, got {s.temperature}")
    if s.HasField("top_p") and not (0 < _finite("top_p", s.top_p) <= 1):
        raise RouterError.invalid("top_p", f"must be in (0, 1], got {s.top_p}")
    if s.HasField("top_k") and s.top_k < -1:
        raise RouterError.invalid("top_k", f"must be -1, 0 (off) or a positive count, got {s.top_k}")
    if s.HasField("min_p") and not (0 <= _finite("min_p", s.min_p) <= 1):
        raise RouterError.invalid("min_p", f"must be in [0, 1], got {s.min_p}")
    if s.HasField("repetition_penalty") and _finite("repetition_penalty", s.repetition_penalty) <= 0:
        raise RouterError.invalid("repetition_penalty", f"must be > 0, got {s.repetition_penalty}")
    for name in ("frequency_penalty", "presence_penalty"):
        if s.HasField(name) and not (-2 <= _finite(name, getattr(s, name)) <= 2):
            raise RouterError.invalid(name, f"must be in [-2, 2], got {getattr(s, name)}")
    if s.HasField("max_tokens") and s.max_tokens < 1:
        raise RouterError.invalid("max_tokens", f"must be >= 1, got {s.max_tokens}")
    if not (0 <= s.top_logprobs <= MAX_TOP_LOGPROBS):
        raise RouterError.invalid("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {s.top_logprobs}")
    for i, stop in enumerate(s.stop):
        if not stop:
            raise RouterError.invalid("stop", f"stop string {i} is empty")
    for tid in s.stop_token_ids:
        if not (0 <= tid < vocab_size):
            raise RouterError.invalid("stop_token_ids", f"token id {tid} is outside [0, {vocab_size})")
    for tid, bias in s.logit_bias.items():
        if not (0 <= tid < vocab_size):
            raise RouterError.invalid("logit_bias", f"token id {tid} is outside [0, {vocab_size})")
        if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise RouterError.invalid("logit_bias", f"bias of token {tid} must be in [-100, 100], got {bias}")
    if tok is not None:
        try:
            spec = structured_from_proto(s)
            if spec is not None:
                tok.grammars.compile(spec)
        except InvalidRequestError as exc:
            raise RouterError.invalid(exc.field, str(exc).removeprefix(f"{exc.field}: ")) from exc


def prepare(req: router_pb2.GenerateRequest, tok: RouterTokenizer,
            default_max_tokens: int | None = DEFAULT_MAX_TOKENS, tenant: str = ANONYMOUS) -> PreparedRequest:
    """Validate and tokenize one request.

    Args:
        req: the client's request (gRPC, or built by the OpenAI layer).
        tok: the served model's tokenizer.
        default_max_tokens: used when ``sampling.max_tokens`` is unset; None means "the rest of the
            context window" (OpenAI chat semantics).
        tenant: the caller's tenant (from its API key).

    Raises:
        RouterError: INVALID_ARGUMENT naming ``model``, ``prompt``/``messages``/``token_ids``,
            ``max_tokens`` or a sampling field.
    """
    card = tok.card
    if req.model and req.model not in (card.id, str(card.path)):
        raise RouterError.invalid("model", f"unknown model {req.model!r}; this router serves {card.id!r}",
                                  err_code="model_not_found")
    validate_sampling(req.sampling, card.vocab_size, tok)
    which = req.WhichOneof("input")
    if which == "text":
        if not req.text:
            raise RouterError.invalid("prompt", "must not be empty")
        ids = tok.encode(req.text)
        field = "prompt"
    elif which == "token_ids":
        ids = list(req.token_ids.ids)
        field = "prompt"
        bad = [t for t in ids if not (0 <= t < card.vocab_size)]
        if bad:
            raise RouterError.invalid(field, f"token id {bad[0]} is outside [0, {card.vocab_size})")
    elif which == "chat":
        field = "messages"
        msgs = []
        for i, m in enumerate(req.chat.messages):
            msg = {"role": m.role, "content": m.content}
            if m.tool_calls_json:
                calls = _json_list(m.tool_calls_json, "tool_calls_json", f"message {i}")
                msg["tool_calls"] = _template_calls(calls)
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
            msgs.append(msg)
        tools = _json_list(req.chat.tools_json, "tools_json", "tools_json") if req.chat.tools_json else None
        if not msgs:
            raise RouterError.invalid(field, "must hold at least one message")
        for i, m in enumerate(msgs):
            if m["role"] not in ("system", "user", "assistant", "tool", "developer"):
                raise RouterError.invalid(field, f"message {i} has unknown role {m['role']!r}")
        try:
            ids = tok.encode_chat(msgs, tools)
        except Exception as exc:  # template errors are the client's input problem
            raise RouterError.invalid(field, f"chat template failed: {exc}") from exc
    else:
        raise RouterError.invalid("prompt", "must not be empty (give text, token_ids or chat)")
    if not ids:
        raise RouterError.invalid(field, "must not be empty (0 tokens)")
    if len(ids) >= card.max_context:
        raise RouterError.invalid(field, f"{len(ids)} prompt tokens do not fit the context window "
                                  f"of {card.max_context} tokens", err_code="context_length_exceeded")
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(req.sampling)
    if not sampling.HasField("max_tokens"):
        room = card.max_context - len(ids)
        sampling.max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    if len(ids) + sampling.max_tokens > card.max_context:
        raise RouterError.invalid("max_tokens", f"{len(ids)} prompt tokens + max_tokens {sampling.max_tokens} "
                                  f"exceed the context window of {card.max_context} tokens",
                                  err_code="context_length_exceeded")
    n, best_of = sample_counts(req.n, req.best_of)
    return PreparedRequest(request_id=req.request_id or f"req-{uuid.uuid4().hex}", input_ids=ids,
                           sampling=sampling, stop=list(sampling.stop), tenant=tenant, n=n, best_of=best_of)


def sample_counts(n: int, best_of: int) -> tuple[int, int]:
    """``(n, best_of)`` of a request, 0 meaning the default (1, and n).

    Raises:
        RouterError: INVALID_ARGUMENT naming ``n`` or ``best_of`` (above MAX_SAMPLES, best_of < n).
    """
    n = n or 1
    if n > MAX_SAMPLES:
        raise RouterError.invalid("n", f"must be in [1, {MAX_SAMPLES}], got {n}")
    best_of = best_of or n
    if not (n <= best_of <= MAX_SAMPLES):
        raise RouterError.invalid("best_of", f"must be in [n={n}, {MAX_SAMPLES}], got {best_of}")
    return n, best_of
