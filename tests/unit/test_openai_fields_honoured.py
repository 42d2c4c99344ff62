"""Every field of the OpenAI request models is honoured or refused: a non-default value either
changes the GenerateRequest the router dispatches, is refused by name, or is one of the few fields
that shape only the HTTP answer (listed, with where they are used). A field added to the models
without one of these fails here."""

import pytest

from router_svc.errors import RouterError
from router_svc.openai_api import chat_to_proto, completion_to_proto
from router_svc.openai_models import ChatRequest, CompletionRequest

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# field -> a non-default value
VALUES = {
    "model": "m", "max_tokens": 3, "temperature": 0.5, "top_p": 0.5, "n": 2, "stop": ["x"], "seed": 3,
    "presence_penalty": 0.5, "frequency_penalty": 0.5, "top_k": 3, "min_p": 0.1, "repetition_penalty": 1.1,
    "ignore_eos": True, "stop_token_ids": [5], "request_id": "r-1", "logit_bias": {"5": 1.0},
    "response_format": {"type": "json_object"}, "best_of": 2, "logprobs": 2, "suffix": "s",
    "prompt": "other", "messages": [{"role": "user", "content": "other"}], "max_completion_tokens": 3,
    "top_logprobs": 2, "tools": [TOOL], "tool_choice": "required",
}
# fields that shape only the HTTP answer: where each is used
RESPONSE_ONLY = {
    "stream": "openai_api._serve: SSE instead of one JSON body",
    "stream_options": "openai_api._stream: the usage chunk",
    "user": "the end user's id (OpenAI: abuse monitoring); no per-user behaviour",
    "parallel_tool_calls": "tool_calls.ToolMode: at most one parsed call (and maxItems 1 when forced)",
    "echo": "openai_choices.Choice: the prompt's text before each choice's text",
}
CHAT_VALUES = {"logprobs": True}
# a field that needs another one set: compared with a base that has the other one
NEEDS = {"tool_choice": {"tools": [TOOL]}, "top_logprobs": {"logprobs": True}}
BASES = {CompletionRequest: {"prompt": "hi"}, ChatRequest: {"messages": [{"role": "user", "content": "hi"}]}}


def _proto(model, body):
    out = (completion_to_proto if model is CompletionRequest else chat_to_proto)(model.model_validate(body))
    req = out if model is CompletionRequest else out[0]
    req.request_id = "" if body.get("request_id") is None else req.request_id
    return req


@pytest.mark.parametrize("model", [CompletionRequest, ChatRequest])
def test_every_field_is_honoured_or_refused(model):
    base = _proto(model, BASES[model])
    for name in model.model_fields:
        if name in RESPONSE_ONLY:
            continue
        assert name in VALUES, f"{model.__name__}.{name}: new field: give it a value here (honoured or refused)"
        value = CHAT_VALUES.get(name, VALUES[name]) if model is ChatRequest else VALUES[name]
        needs = NEEDS.get(name, {}) if model is ChatRequest else {}
        body = dict(BASES[model], **needs, **{name: value})
        base_cmp = _proto(model, dict(BASES[model], **needs)) if needs else base
        try:
            req = _proto(model, body)
        except RouterError as e:
            assert e.param == name, (name, e.param)
            continue
        assert req != base_cmp, f"{model.__name__}.{name} is accepted but changes nothing"
