"""Tool-call parsing and the forced-choice schemas (router_svc/tool_calls.py)."""

import json

import jsonschema
import pytest

from router_svc.tool_calls import ToolMode, ToolStreamer, parse_auto, required_schema

NAMES = {"get_weather", "get_time"}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}} for n in sorted(NAMES)]


def test_hermes_blocks():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"city": "Rome"}}</tool_call>')
    content, calls = parse_auto(text, NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {"city": "Rome"})]
    assert len({c.id for c in calls}) == 2
    assert len(parse_auto(text, NAMES, parallel=False)[1]) == 1


def test_llama3_json_calls():
    content, calls = parse_auto('<|python_tag|>{"name": "get_time", "parameters": {"city": "Oslo"}}', NAMES)
    assert content == "" and calls[0].name == "get_time" and json.loads(calls[0].arguments) == {"city": "Oslo"}
    _, calls = parse_auto('{"name": "get_time", "parameters": {"city": "A"}}; '
                          '{"name": "get_weather", "parameters": {"city": "B"}}', NAMES)
    assert [c.name for c in calls] == ["get_time", "get_weather"]


@pytest.mark.parametrize("text", ["The weather is nice.", '{"name": "unknown", "parameters": {}}',
                                  '{"name": "get_time", "parameters": {}} and then some text',
                                  "<tool_call>{not json}</tool_call>", '{"city": "Paris"}'])
def test_not_a_call_stays_content(text):
    content, calls = parse_auto(text, NAMES)
    assert calls == [] and content == text


def test_required_schema_accepts_calls_and_rejects_others():
    schema = required_schema(TOOLS)
    jsonschema.validate([{"name": "get_time", "parameters": {"city": "x"}}], schema)
    for bad in ([], [{"name": "nope", "parameters": {"city": "x"}}], [{"name": "get_time", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"city": "x"}}] * 2, required_schema(TOOLS, False))


def test_modes_parse_their_constrained_output():
    _, calls = ToolMode("named", TOOLS, "get_time").parse('{"city": "Oslo"}')
    assert calls[0].name == "get_time" and json.loads(calls[0].arguments) == {"city": "Oslo"}
    content, calls = ToolMode("required", TOOLS).parse('[{"name": "get_weather", "parameters": {"city": "B"}}]')
    assert content is None and calls[0].name == "get_weather"


def _stream(mode, pieces):
    s = ToolStreamer(mode)
    sent = [s.feed(p) for p in pieces]
    rest, calls = s.finish()
    return "".join(sent) + rest, [x for x in sent if x], calls


def test_streamer_sends_content_then_holds_the_hermes_call():
    pieces = ["Let me", " check", ".\n<tool", '_call>{"name": "get_time", ', '"arguments": {"city": "A"}}</tool_call>']
    content, sent, calls = _stream(ToolMode("auto", TOOLS), pieces)
    assert content.rstrip() == "Let me check." and sent[:2] == ["Let me", " check"]
    assert [c.name for c in calls] == ["get_time"]
    whole = "".join(pieces)
    # the non-streamed answer's content (whitespace already streamed before the call may remain)
    assert ToolMode("auto", TOOLS).parse(whole)[0] == content.rstrip()


def test_streamer_holds_a_llama_call_and_a_partial_marker():
    content, sent, calls = _stream(ToolMode("auto", TOOLS), ['{"name": "get_time",', ' "parameters": {"city": "B"}}'])
    assert sent == [] and content == "" and calls[0].name == "get_time"
    content, sent, calls = _stream(ToolMode("auto", TOOLS), ["a <", "tool", " box"])
    assert content == "a <tool box" and calls == [] and sent[0] == "a "


def test_streamer_plain_json_content_is_not_lost():
    content, _, calls = _stream(ToolMode("auto", TOOLS), ['{"x": ', "1}"])
    assert content == '{"x": 1}' and calls == []


def test_streamer_forced_call_is_held_whole():
    content, sent, calls = _stream(ToolMode("named", TOOLS, "get_time"), ['{"city"', ': "C"}'])
    assert sent == [] and content == "" and json.loads(calls[0].arguments) == {"city": "C"}
