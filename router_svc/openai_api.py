"""OpenAI-compatible HTTP API on the router: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models`` (+ ``/health``), JSON or server-sent events (``stream: true``).

Requests map onto the same :class:`~protos.router_pb2.GenerateRequest` the gRPC API takes, and run
through the same validation and dispatcher. Bodies follow the OpenAI API reference: usage with
``prompt_tokens_details.cached_tokens``, logprobs in the completions (``tokens``/``token_logprobs``/
``top_logprobs``/``text_offset``) and chat (``content: [{token, logprob, bytes, top_logprobs}]``)
shapes, and errors as ``{"error": {"message", "type", "param", "code"}}`` (HTTP 400 for bad input,
naming the field). vLLM-style extras are accepted: ``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``.

Bodies are parsed strictly: a field of the wrong JSON type (``"max_tokens": "5"``, ``"stream": 1``)
or one the models do not declare is a 400 naming it, never coerced or dropped; OpenAI fields the
router cannot honour (``suffix``, ``echo`` with ``logprobs``) are refused by name. ``n`` and
``best_of`` run several samples (router_svc/fanout.py; one choice each, router_svc/openai_choices.py);
``echo`` puts the prompt's text before each completion.
``logit_bias`` (token id strings -> bias in [-100, 100]) and ``response_format`` (``text``,
``json_object``, ``json_schema``; on completions too, as vLLM) are honoured by the workers' sampler.
API keys and the body size limit are checked before this app
(:class:`~router_svc.http_guard.FrontDoorMiddleware`, which sets ``request.state.tenant``); rate
limits and the admission queue answer 429 with ``Retry-After`` before validation.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from protos import common_pb2, router_pb2
from router_svc.api_keys import ANONYMOUS
from router_svc.dispatch import Dispatcher
from router_svc.errors import RouterError
from router_svc.fanout import generate_n
from router_svc.openai_choices import Choice, usage
from router_svc.openai_models import ChatRequest, CompletionRequest, NamedToolChoice, ResponseFormat, _Common
from router_svc.tool_calls import NAME_RE, ToolMode
from router_svc.validation import DEFAULT_MAX_TOKENS, prepare, sample_counts


def _samples(body: _Common, req: router_pb2.GenerateRequest) -> None:
    """``n`` / ``best_of`` -> the request's sample counts (router_svc/fanout.py)."""
    if body.n < 1:
        raise RouterError.invalid("n", f"must be >= 1, got {body.n}")
    if body.best_of is not None and body.best_of < 1:
        raise RouterError.invalid("best_of", f"must be >= 1, got {body.best_of}")
    n, best_of = sample_counts(body.n, body.best_of or 0)
    if body.stream and best_of > n:  # as OpenAI: the best are known only once all finished
        raise RouterError.invalid("best_of", f"best_of {best_of} > n {n} cannot be streamed")
    req.n, req.best_of = n, best_of


def _sampling(body: _Common, logprobs: bool, top_logprobs: int) -> common_pb2.SamplingParams:
    if body.stream_options is not None and not body.stream:
        raise RouterError.invalid("stream_options", "is only allowed with stream: true")
    if body.seed is not None and not (0 <= body.seed < 2**64):
        raise RouterError.invalid("seed", f"must be in [0, 2**64), got {body.seed}")
    s = common_pb2.SamplingParams(ignore_eos=body.ignore_eos, logprobs=logprobs, top_logprobs=top_logprobs)
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "frequency_penalty",
                 "presence_penalty", "max_tokens"):
        value = getattr(body, name)
        if value is not None:
            setattr(s, name, value)
    if body.stop is not None:
        s.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.stop_token_ids:
        s.stop_token_ids.extend(body.stop_token_ids)
    for key, bias in (body.logit_bias or {}).items():
        # OpenAI's keys are token ids as strings; validate_sampling checks the id and bias ranges
        if not key.strip().isdigit() or int(key) >= 2**31:
            raise RouterError.invalid("logit_bias", f"keys must be token ids (integers as strings), got {key!r}")
        s.logit_bias[int(key)] = bias
    _response_format(body.response_format, s)
    return s


def _response_format(rf: ResponseFormat | None, s: common_pb2.SamplingParams) -> None:
    """``response_format`` -> ``sampling.structured``; its schema is compiled in prepare()."""
    if rf is None or rf.type == "text":
        if rf is not None and rf.json_schema is not None:
            raise RouterError.invalid("response_format", "json_schema is only allowed with type json_schema")
        return
    if rf.type == "json_object":
        if rf.json_schema is not None:
            raise RouterError.invalid("response_format", "json_schema is only allowed with type json_schema")
        s.structured.json_object = True
        return
    if rf.json_schema is None:
        raise RouterError.invalid("response_format", "type json_schema needs a json_schema object")
    s.structured.json_schema = json.dumps(rf.json_schema.schema_)


def completion_to_proto(body: CompletionRequest) -> router_pb2.GenerateRequest:
    """Map a /v1/completions body; raises RouterError naming the field for unsupported input."""
    if body.echo and body.logprobs is not None:
        raise RouterError.invalid("echo", "echo with logprobs (the prompt's logprobs) is not supported")
    if body.suffix:
        raise RouterError.invalid("suffix", "suffix is not supported")
    if body.logprobs is not None and not (0 <= body.logprobs <= 20):
        raise RouterError.invalid("logprobs", f"must be in [0, 20], got {body.logprobs}")
    req = router_pb2.GenerateRequest(request_id=body.request_id or f"cmpl-{uuid.uuid4().hex}", model=body.model,
                                     sampling=_sampling(body, body.logprobs is not None, body.logprobs or 0))
    _samples(body, req)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise RouterError.invalid("prompt", "batched prompts are not supported; send one prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def tool_mode(body: ChatRequest) -> ToolMode | None:
    """``tools`` / ``tool_choice`` -> how the output becomes tool calls (None: no tools in play).

    Raises:
        RouterError: "tools" (empty, bad or duplicate names), "tool_choice" (no tools, unknown
            function, or with a response_format), "messages" (a tool message without tool_call_id).
    """
    for i, m in enumerate(body.messages):
        if m.role == "tool" and not m.tool_call_id:
            raise RouterError.invalid("messages", f"message {i}: a tool message needs tool_call_id")
        if m.role != "tool" and m.tool_call_id is not None:
            raise RouterError.invalid("messages", f"message {i}: tool_call_id is only for tool messages")
        if m.role != "assistant" and m.tool_calls is not None:
            raise RouterError.invalid("messages", f"message {i}: tool_calls is only for assistant messages")
    choice = body.tool_choice
    if body.tools is None:
        if choice not in (None, "none"):
            raise RouterError.invalid("tool_choice", "needs tools")
        return None
    if not body.tools:
        raise RouterError.invalid("tools", "must hold at least one tool (or leave tools out)")
    names = [t.function.name for t in body.tools]
    for n in names:
        if not NAME_RE.match(n):
            raise RouterError.invalid("tools", f"function name {n!r} must match {NAME_RE.pattern}")
    if len(set(names)) != len(names):
        raise RouterError.invalid("tools", "function names must be unique")
    if choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise RouterError.invalid("tool_choice", f"function {choice.function.name!r} is not in tools")
        mode = ToolMode("named", tools, choice.function.name, body.parallel_tool_calls)
    else:
        mode = ToolMode(choice or "auto", tools, parallel=body.parallel_tool_calls)
    if mode.schema() is not None and body.response_format is not None and body.response_format.type != "text":
        raise RouterError.invalid("tool_choice", "a forced tool call cannot be combined with response_format")
    return mode


def chat_to_proto(body: ChatRequest) -> tuple[router_pb2.GenerateRequest, ToolMode | None]:
    """Map a /v1/chat/completions body (text content parts only); also returns its tool mode."""
    if body.max_completion_tokens is not None and body.max_tokens is None:
        body.max_tokens = body.max_completion_tokens
    top = body.top_logprobs or 0
    if top and not body.logprobs:
        raise RouterError.invalid("top_logprobs", "needs logprobs: true")
    mode = tool_mode(body)
    req = router_pb2.GenerateRequest(request_id=body.request_id or f"chatcmpl-{uuid.uuid4().hex}", model=body.model,
                                     sampling=_sampling(body, body.logprobs, top))
    _samples(body, req)
    req.chat.SetInParent()
    if mode is not None:
        req.chat.tools_json = json.dumps(mode.tools)
        schema = mode.schema()
        if schema is not None:
            req.sampling.structured.json_schema = json.dumps(schema)
    for m in body.messages:
        content = m.content or ""
        if isinstance(content, list):   # TextPart: only text parts parse
            content = "".join(part.text for part in content)
        msg = req.chat.messages.add(role=m.role, content=content, tool_call_id=m.tool_call_id or "")
        if m.tool_calls:
            msg.tool_calls_json = json.dumps([c.model_dump() for c in m.tool_calls])
    return req, mode


async def _indexed(stream):
    """One request's responses as choice 0's."""
    try:
        async for resp in stream:
            yield 0, resp
    finally:
        await stream.aclose()


async def _chain(first, stream):
    yield first
    async for item in stream:
        yield item


def _error_response(exc: RouterError) -> JSONResponse:
    return JSONResponse(exc.openai_body(), status_code=exc.http_status, headers=exc.http_headers)


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def build_app(dispatcher: Dispatcher) -> FastAPI:
    """The FastAPI app serving the OpenAI routes over ``dispatcher``."""
    app = FastAPI(title="halfmoon router", docs_url=None, redoc_url=None)
    card = dispatcher.tok.card

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and not isinstance(p, int)]
        param = loc[0] if loc else None
        msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request body')}"
        return _error_response(RouterError(grpc.StatusCode.INVALID_ARGUMENT, msg, param))

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError):
        return _error_response(exc)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        # FastAPI's own refusals (a body that is not UTF-8 JSON, an unknown route, a wrong method)
        # get the OpenAI error body too, not {"detail": ...}
        etype = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"body: {exc.detail}" if exc.status_code == 400 else str(exc.detail)
        return JSONResponse({"error": {"message": message, "type": etype, "param": None,
                                       "code": str(exc.status_code)}},
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health():
        ok = dispatcher.pool.healthy_count("prefill") > 0 and dispatcher.pool.healthy_count("decode") > 0
        return JSONResponse({"status": "ok" if ok else "no healthy workers"}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": card.id, "object": "model", "created": 0, "owned_by": "halfmoon",
                                            "max_model_len": card.max_context}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(request, completion_to_proto(body), body, chat=False, echo=body.echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        req, tools = chat_to_proto(body)
        return await _serve(request, req, body, chat=True, tools=tools)

    async def _serve(request: Request, req: router_pb2.GenerateRequest, body: _Common, chat: bool,
                     tools: ToolMode | None = None, echo: bool = False):
        arrival = time.monotonic()
        tenant = getattr(request.state, "tenant", ANONYMOUS)
        ticket = dispatcher.admit(tenant, arrival)
        try:
            prep = prepare(req, dispatcher.tok, default_max_tokens=None if chat else DEFAULT_MAX_TOKENS, tenant=tenant)
        except RouterError as exc:
            ticket.close()
            dispatcher.count("invalid", arrival, tenant)
            if exc.param == "structured":  # the gRPC field is this body's response_format
                raise RouterError.invalid("response_format", exc.message.removeprefix("structured: ")) from exc
            raise
        head = {"id": prep.request_id, "created": int(time.time()), "model": card.id}
        prompt = "" if not echo else req.text or dispatcher.tok.hf.decode(prep.input_ids, skip_special_tokens=False)
        choices = [Choice(i, dispatcher.tok, chat, tools, prompt) for i in range(prep.n)]
        if prep.n == 1 and prep.best_of == 1:
            stream = _indexed(dispatcher.generate(prep, arrival=arrival, ticket=ticket))
        else:
            stream = generate_n(dispatcher, prep, arrival=arrival, ticket=ticket)
        if body.stream:
            # Run to the first token before answering 200, so that failures before it (no worker,
            # both attempts failed, a worker's RESOURCE_EXHAUSTED) get their HTTP status and body.
            first = await anext(stream)
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_stream(first, stream, head, chat, choices, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _collect(request, stream, head, chat, choices)

    async def _collect(request, stream, head, chat, choices):
        async def consume():
            async for index, resp in stream:
                choices[index].add(resp)

        task = asyncio.ensure_future(consume())
        while not task.done():  # a client that disconnects cancels the request (and every leg)
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return JSONResponse({"error": {"message": "client disconnected", "type": "cancelled",
                                               "param": None, "code": "cancelled"}}, status_code=499)
        task.result()  # raises RouterError -> handler
        return dict(head, object="chat.completion" if chat else "text_completion",
                    choices=[c.body() for c in choices], usage=usage(choices))

    async def _stream(first, stream, head, chat, choices, include_usage) -> AsyncIterator[bytes]:
        base = dict(head, object="chat.completion.chunk" if chat else "text_completion")
        try:
            if chat:
                for c in choices:
                    yield _sse(dict(base, choices=[c.role_delta()]))
            async for index, resp in _chain(first, stream):
                choice = choices[index].delta(resp)
                if choice is not None:
                    yield _sse(dict(base, choices=[choice]))
            if include_usage:
                yield _sse(dict(base, choices=[], usage=usage(choices)))
        except RouterError as exc:
            yield _sse(exc.openai_body())
        finally:
            await stream.aclose()
        yield _sse("[DONE]")

    return app


__all__ = ["build_app", "CompletionRequest", "ChatRequest"]
