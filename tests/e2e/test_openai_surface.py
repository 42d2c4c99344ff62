"""The OpenAI surface agents use, end to end on 1 prefill + 1 decode through the router (real
processes, real ``openai`` client): ``logit_bias`` on P's first token and D's later tokens,
structured outputs (JSON Schema, json_object, regex through gRPC) enforced by the grammar on P and
D, and the KV accounting once idle. One stack for the module."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from protos import common_pb2, router_pb2
from tests.e2e.conftest import stack_fixture, worker_targets
from tests.integration.conftest import MODEL, assert_idle_accounting

stack = stack_fixture(prefill=1, decode=1)

PROMPT = "The lighthouse keeper climbed the stairs and"


# ---------------------------------------------------------------- logit_bias

def _token_ids(stub, **sampling) -> list[int]:
    req = router_pb2.GenerateRequest(text=PROMPT, sampling=common_pb2.SamplingParams(temperature=0, **sampling))
    return [t for resp in stub.Generate(req, timeout=60) for t in resp.token_ids]


def test_logit_bias_plus_100_forces_a_token_on_p_and_d(client, stub, tok):
    forced = tok.encode(" banana")[-1]
    base = _token_ids(stub, max_tokens=4)
    assert forced not in base
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4,
                                  logit_bias={str(forced): 100})
    # the first token is P's, the other three D's: each must be the forced one
    assert r.choices[0].text == " banana" * 4, r.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          temperature=0, max_tokens=3, logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == " banana" * 3


def test_logit_bias_minus_100_bans_the_greedy_token_on_p_and_d(stub):
    g = _token_ids(stub, max_tokens=4)
    first_banned = _token_ids(stub, max_tokens=4, logit_bias={g[0]: -100})
    assert first_banned[0] != g[0]                      # P honoured the ban
    a, b = first_banned[0], first_banned[1]
    assert a != b
    both = _token_ids(stub, max_tokens=4, logit_bias={g[0]: -100, b: -100})
    assert both[0] == a and both[1] != b                # D honoured it (P's token unchanged)
    assert g[0] not in both and b not in both


def test_logit_bias_is_validated_by_name(client):
    for bias in ({"x": 1}, {"1": 101}, {"1": -100.5}, {str(10**6): 1}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias=bias)
        assert e.value.body["param"] == "logit_bias", (bias, e.value.body)


# ---------------------------------------------------------------- structured outputs

NAME = {"type": "string", "maxLength": 16}
SCHEMAS = [
    ("Describe a person.", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer"}},
                            "required": ["name", "age"]}),
    ("Describe a city.", {"type": "object", "properties": {"city": NAME, "population": {"type": "integer"},
                                                           "capital": {"type": "boolean"}},
                          "required": ["city", "population", "capital"]}),
    ("Pick a colour.", {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
                        "required": ["colour"]}),
    ("List three fruits.", {"type": "object", "properties": {"fruits": {"type": "array", "items": NAME,
                                                                        "minItems": 3, "maxItems": 3}},
                            "required": ["fruits"]}),
    ("Give a book.", {"type": "object", "properties": {"book": {"type": "object", "properties": {
        "title": NAME, "author": {"type": "object", "properties": {"first": NAME, "last": NAME},
                                  "required": ["first", "last"]}}, "required": ["title", "author"]}},
        "required": ["book"]}),
    ("Rate the film from 1 to 5.", {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1,
                                                                              "maximum": 5}},
                                    "required": ["stars"]}),
    ("Is the sky blue?", {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    ("A point in 2D.", {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                        "required": ["x", "y"]}),
    ("Weather report.", {"type": "object", "properties": {
        "sky": {"enum": ["sunny", "cloudy", "rainy"]}, "celsius": {"type": "integer", "minimum": -50, "maximum": 60}},
        "required": ["sky", "celsius"]}),
    ("An order.", {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"]}}}, "required": ["items"]}),
    ("Numbers.", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 5}),
    ("A yes/no answer.", {"enum": ["yes", "no"]}),
    ("A tag list.", {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                               "maxItems": 4}}, "required": ["tags"]}),
    ("User profile.", {"type": "object", "properties": {"user": NAME, "email": NAME,
                                                        "admin": {"type": "boolean"}, "karma": {"type": "integer"}},
                       "required": ["user", "admin", "karma"]}),
    ("Pet.", {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "name": NAME,
                                               "legs": {"const": 4}}, "required": ["kind", "name", "legs"]}),
    ("Matrix.", {"type": "object", "properties": {"rows": {"type": "array", "maxItems": 2, "minItems": 2, "items": {
        "type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}}}, "required": ["rows"]}),
    ("Null or number.", {"type": "object", "properties": {"v": {"anyOf": [{"type": "null"}, {"type": "integer"}]}},
                         "required": ["v"]}),
    ("Temperature.", {"type": "object", "properties": {"t": {"type": "number", "minimum": 0, "maximum": 100}},
                      "required": ["t"]}),
    ("Address.", {"type": "object", "properties": {"street": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                  "required": ["street", "zip"], "additionalProperties": False}),
    ("Flags.", {"type": "object", "properties": {"on": {"type": "boolean"}, "off": {"type": "boolean"},
                                                 "mode": {"enum": ["fast", "slow"]}},
                "required": ["on", "off", "mode"]}),
]


def _chat_json(client, prompt: str, schema: dict, i: int) -> str:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt + " Answer in JSON."}], temperature=0,
        max_tokens=120, response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
    assert r.choices[0].finish_reason == "stop", (prompt, r.choices[0])
    return r.choices[0].message.content


def test_json_schema_outputs_parse_and_validate(client, stack):
    with ThreadPoolExecutor(len(SCHEMAS)) as ex:  # concurrently: one decode batch
        outs = list(ex.map(lambda a: _chat_json(client, *a), [(p, s, i) for i, (p, s) in enumerate(SCHEMAS)]))
    for (prompt, schema), text in zip(SCHEMAS, outs):
        jsonschema.validate(json.loads(text), schema)
    assert_idle_accounting(worker_targets(stack), credentials=stack.credentials.client())


def test_json_object_and_completions_response_format(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Give a JSON object with a greeting."}],
                                       temperature=0, max_tokens=100, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=MODEL, prompt="A person:", temperature=0, max_tokens=60,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                      "name": "p", "schema": SCHEMAS[0][1]}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[0][1])


def test_json_schema_streamed(client):
    chunks = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick a colour."}], temperature=0, max_tokens=40,
        stream=True, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMAS[2][1]}})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[2][1])


def test_regex_through_grpc_matches(stub):
    for pattern in (r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r"(yes|no), because [a-z ]{1,20}\.", r"[A-Z][a-z]{1,8} [A-Z][a-z]{1,8}"):
        s = common_pb2.SamplingParams(temperature=0, max_tokens=40)
        s.structured.regex = pattern
        resps = list(stub.Generate(router_pb2.GenerateRequest(text=PROMPT, sampling=s), timeout=60))
        text = "".join(r.text for r in resps)
        assert re.fullmatch(pattern, text), (pattern, text)
        assert resps[-1].finish_reason == "stop"


def test_ebnf_through_grpc(stub):
    s = common_pb2.SamplingParams(temperature=0, max_tokens=20)
    s.structured.ebnf = 'root ::= "A" | "B" "!"'
    text = "".join(r.text for r in stub.Generate(router_pb2.GenerateRequest(text=PROMPT, sampling=s), timeout=60))
    assert text in ("A", "B!"), text


@pytest.mark.parametrize("rf", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}}},
    {"type": "json_schema"},
    {"type": "xml"},
])
def test_malformed_response_format_is_400_naming_it(client, rf):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       response_format=rf)
    assert e.value.body["param"] == "response_format", e.value.body


def test_bad_grammar_through_grpc_names_structured(stub):
    import grpc

    for field, value in (("regex", "("), ("ebnf", "root ::= "), ("json_schema", "{not json")):
        s = common_pb2.SamplingParams(max_tokens=2)
        setattr(s.structured, field, value)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(router_pb2.GenerateRequest(text=PROMPT, sampling=s), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured" in e.value.details()


# ---------------------------------------------------------------- tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(call, name: str, schema: dict) -> dict:
    assert call.type == "function" and call.id and call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    return args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_gives_a_valid_call(client, choice):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                       temperature=0, max_tokens=80)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    names = {"get_weather": WEATHER, "get_time": TIME}
    for call in c.message.tool_calls:
        _check_call(call, call.function.name, names[call.function.name]["function"]["parameters"])
    if isinstance(choice, dict):
        assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]


def test_tool_call_round_trip(client, stack):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0, max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    args = _check_call(call, "get_weather", WEATHER["function"]["parameters"])
    messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id,
                       "content": json.dumps({"city": args["city"], "temperature": 21, "sky": "sunny"})}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=30)
    c = final.choices[0]
    assert c.message.tool_calls is None and c.message.content and c.finish_reason in ("stop", "length")
    # the call and its result reached the prompt: more than the question alone (tool_choice none
    # offers no tools, as vLLM by default)
    alone = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=1)
    assert final.usage.prompt_tokens > alone.usage.prompt_tokens + 20
    assert_idle_accounting(worker_targets(stack), credentials=stack.credentials.client())


def test_forced_tool_call_streamed(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=80,
        stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].index == 0 and deltas[0].function.name == "get_weather"
    jsonschema.validate(json.loads(deltas[0].function.arguments), WEATHER["function"]["parameters"])
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_auto_tool_choice_answers_or_calls(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60)
    c = r.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        _check_call(c.message.tool_calls[0], "get_weather", {"type": "object"})
    else:
        assert c.message.content and "<tool_call>" not in c.message.content


@pytest.mark.parametrize("extra, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
])
def test_bad_tool_fields_are_400_naming_them(client, extra, param):
    body = dict({"messages": ASK, "max_tokens": 2}, **extra)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, **body)
    assert e.value.body["param"] == param, e.value.body


def test_auto_tool_choice_streamed_equals_non_streamed(client):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=60)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = [ch.choices[0] for ch in client.chat.completions.create(stream=True, **kw) if ch.choices]
    content = "".join(c.delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.delta.tool_calls or [])]
    assert content.strip() == (whole.message.content or "").strip()
    assert [(t.function.name, t.function.arguments) for t in calls] == \
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or []]
    assert chunks[-1].finish_reason == whole.finish_reason
    if not calls:  # a plain answer streams as it is generated, not in one piece at the end
        assert sum(1 for c in chunks if c.delta.content) > 1
