"""The OpenAI request bodies, parsed strictly: no coercion between JSON types, and an unknown field
is a 400 naming it (router_svc/openai_api.py maps them onto GenerateRequest)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


# The proto fields these map onto are int32: a larger JSON integer is a 400 naming the field, not a
# protobuf ValueError (HTTP 500) when the GenerateRequest is built.
Int32 = Annotated[int, Field(ge=-2**31, le=2**31 - 1)]


# strict: no coercion between JSON types; forbid: an unknown field is a 400 naming it.
_STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(BaseModel):
    model_config = _STRICT
    model: str = ""
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM / SGLang extras
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Int32] | None = None
    request_id: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None  # completions too, as vLLM
    # samples generated, the n best returned (openai_api._samples, router_svc/fanout.py)
    best_of: Int32 | None = None


class CompletionRequest(_Common):
    prompt: str | list[Int32] | list[str] | list[list[Int32]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls are always grammar-enforced


class ToolDef(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    model_config = _STRICT
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None   # assistant
    tool_call_id: str | None = None              # tool


class ChatRequest(_Common):
    messages: list[ChatMessage]
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
