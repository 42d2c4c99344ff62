"""OpenAI tool calls on chat: how tools reach the prompt, how ``tool_choice`` constrains the output,
and how the output is parsed back into ``message.tool_calls``.

- Prompt: a model whose chat template takes ``tools`` (Qwen, Llama 3.1, Hermes) gets them through
  ``apply_chat_template(tools=...)``; a template that ignores them (SmolLM2) gets a Hermes-style
  system block instead (:func:`tools_system_prompt`), so offered tools are never dropped.
- ``tool_choice`` (vLLM's approach): ``auto`` leaves the output free and parses it; ``none`` offers
  no tools and parses nothing; ``required`` constrains the output to a JSON array of
  ``{"name", "parameters"}`` calls (:func:`required_schema`); a named function constrains it to
  that function's parameters (:func:`named_schema`). The grammar (engine/grammar.py) enforces both.
- Parsing ``auto`` output (:func:`parse_auto`): Hermes / Qwen ``<tool_call>{"name", "arguments"}
  </tool_call>`` blocks, and Llama 3 JSON ``{"name", "parameters"}`` (optionally after
  ``<|python_tag|>``), naming an offered tool. Anything else stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass
class ToolCall:
    """One parsed call: ``arguments`` is JSON text (the OpenAI wire shape)."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


def tools_system_prompt(tools: list[dict]) -> str:
    """The Hermes function-calling system block, for templates that do not render ``tools``."""
    sigs = "\n".join(json.dumps(t) for t in tools)
    return ("You may call one or more functions to assist with the user query. The functions are listed "
            f"in <tools></tools>:\n<tools>\n{sigs}\n</tools>\nFor each function call, return a JSON object "
            "with the function name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _params(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def named_schema(tools: list[dict], name: str) -> dict:
    """JSON Schema of a forced call to ``name``: its parameters object."""
    return next(_params(t) for t in tools if t["function"]["name"] == name)


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """JSON Schema of ``tool_choice: required``: an array of 1 (or more, when ``parallel``) calls."""
    one = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                       "parameters": _params(t)},
                      "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}
    schema = {"type": "array", "items": one, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_named(text: str, name: str) -> list[ToolCall]:
    """Output constrained by :func:`named_schema` -> the one call."""
    return [ToolCall(name, json.dumps(json.loads(text)))]


def parse_required(text: str) -> list[ToolCall]:
    """Output constrained by :func:`required_schema` -> its calls, in order."""
    return [ToolCall(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]


def _call(obj, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments already as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args))


def parse_auto(text: str, names: set[str], parallel: bool = True) -> tuple[str, list[ToolCall]]:
    """Free output -> (content left, calls). Only calls naming an offered tool count; with
    ``parallel`` False only the first call is returned."""
    calls: list[ToolCall] = []
    if "<tool_call>" in text:
        for m in _HERMES.finditer(text):
            try:
                call = _call(json.loads(m.group(1)), names)
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
        content = text[:text.index("<tool_call>")].strip() if calls else text
    else:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        calls, content = [], text
        dec, pos = json.JSONDecoder(), 0
        while body.startswith("{", pos):  # Llama 3: one or more JSON calls, ';'-separated
            try:
                obj, end = dec.raw_decode(body, pos)
            except ValueError:
                break
            call = _call(obj, names)
            if call is None:
                break
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n;":
                pos += 1
        if calls and pos < len(body):  # trailing text that is not a call: not a tool-call output
            calls = []
        if calls:
            content = ""
    return content, calls[:1] if not parallel else calls


@dataclass
class ToolMode:
    """How one chat request's output becomes tool calls.

    Attributes:
        choice: "auto", "required" or "named" ("none" builds no ToolMode).
        tools: the offered tools (OpenAI shape).
        name: the forced function for "named".
        parallel: ``parallel_tool_calls``.
    """

    choice: str
    tools: list[dict]
    name: str = ""
    parallel: bool = True

    def schema(self) -> dict | None:
        """The JSON Schema that enforces the choice, or None (auto: free output)."""
        if self.choice == "named":
            return named_schema(self.tools, self.name)
        if self.choice == "required":
            return required_schema(self.tools, self.parallel)
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output -> (message content or None, calls)."""
        if self.choice == "named":
            return None, parse_named(text, self.name)
        if self.choice == "required":
            return None, parse_required(text)
        content, calls = parse_auto(text, {t["function"]["name"] for t in self.tools}, self.parallel)
        return (content or None) if calls else content, calls


_MARK = "<tool_call>"
_LLAMA_STARTS = ("{", "<|python_tag|>")


class ToolStreamer:
    """Streams ``auto`` output as content while it cannot be a call, and holds back what may be one.

    Held: an output that starts (after whitespace) like a Llama 3 call (``{`` or ``<|python_tag|>``),
    everything from a ``<tool_call>`` on, and a tail that could be the start of one. At the end the
    held text is parsed with :func:`parse_auto` over the whole output, so content and calls are what
    the non-streamed answer gives.
    """

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""
        self.sent = 0       # characters of ``text`` already streamed as content
        self.holding = mode.choice != "auto"  # forced calls: the whole output is the call

    def feed(self, delta: str) -> str:
        """Add generated text; returns the content that can be streamed now ("" when held)."""
        self.text += delta
        if self.holding:
            return ""
        head = self.text.lstrip()
        if not head or any(s.startswith(head[:len(s)]) for s in _LLAMA_STARTS):
            if self.sent == 0:  # may be a Llama 3 call: nothing streamed yet, wait
                return ""
        if _MARK in self.text[self.sent:]:
            out = self.text[self.sent:self.text.index(_MARK, self.sent)]
            self.holding = True
        else:
            keep = next((k for k in range(min(len(_MARK) - 1, len(self.text) - self.sent), 0, -1)
                         if self.text.endswith(_MARK[:k])), 0)
            out = self.text[self.sent:len(self.text) - keep]
        self.sent += len(out)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """-> (the content not streamed yet, the calls). Raises ValueError like ToolMode.parse."""
        _, calls = self.mode.parse(self.text)
        if not calls:
            return self.text[self.sent:], []
        if self.mode.choice == "auto" and _MARK in self.text[self.sent:]:  # Hermes: content before the call
            return self.text[self.sent:self.text.index(_MARK, self.sent)].rstrip(), calls
        return "", calls
