"""The OpenAI bodies are parsed strictly: a wrong JSON type, an unknown field or an OpenAI field the
router cannot honour is a 400 naming it (found by tests/integration/test_fuzz.py; each case here was
accepted, coerced or silently ignored before). The pool has no workers: a valid body gets 503."""

import pytest
from fastapi.testclient import TestClient

from engine.model_store import resolve_model
from router_svc.dispatch import Dispatcher
from router_svc.openai_api import build_app
from router_svc.policies import make_policy
from router_svc.pool import WorkerPool
from router_svc.tokenizer import RouterTokenizer

MODEL = "smollm2-135m-instruct"
CMPL = {"prompt": "hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def client():
    tok = RouterTokenizer(MODEL, resolve_model(MODEL))
    d = Dispatcher(tok, WorkerPool(), make_policy("round_robin"), make_policy("round_robin"))
    with TestClient(build_app(d)) as c:
        yield c


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"logit_bias": {"a": "b"}}, "logit_bias"),     # garbage, was ignored
    ("/v1/completions", {"logit_bias": "x"}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"50256": -100}}, "logit_bias"),  # id beyond the vocabulary (49152)
    ("/v1/chat/completions", {"logit_bias": {"1": 101}}, "logit_bias"),   # |bias| > 100
    ("/v1/chat/completions", {"logit_bias": {"-1": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"1.5": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"99999999999": 5}}, "logit_bias"),
    ("/v1/completions", {"n": 3, "best_of": 2}, "best_of"),                 # best_of < n
    ("/v1/completions", {"best_of": 17}, "best_of"),                      # > MAX_SAMPLES
    ("/v1/completions", {"best_of": 0}, "best_of"),
    ("/v1/completions", {"best_of": 3, "stream": True}, "best_of"),       # the best are known at the end
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"n": -1}, "n"),
    ("/v1/chat/completions", {"n": 17}, "n"),
    ("/v1/completions", {"n": 2**40}, "n"),                               # was a protobuf ValueError
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),           # needs the prompt's logprobs
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/completions", {"max_tokens": "2"}, "max_tokens"),            # was coerced
    ("/v1/completions", {"max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"stream": 1}, "stream"),
    ("/v1/completions", {"temperature": "0"}, "temperature"),
    ("/v1/completions", {"ignore_eos": "yes"}, "ignore_eos"),
    ("/v1/completions", {"seed": True}, "seed"),
    ("/v1/completions", {"stop_token_ids": ["1"]}, "stop_token_ids"),
    ("/v1/completions", {"frobnicate": 1}, "frobnicate"),              # unknown field, was dropped
    ("/v1/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/completions", {"response_format": "json"}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object", "json_schema": {"name": "a"}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format"),                                                # name is required
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "a", "schema": {"type": "nope"}}}},
     "response_format"),                                                # malformed schema
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "a", "schema": {"type": "object",
                                                                  "required": 5}}}}, "response_format"),
    ("/v1/chat/completions", {"tools": []}, "tools"),
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ("/v1/completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages"),                                                      # was str()-ed into "5"
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": 1, "content": "x"}]}, "messages"),
])
def test_refused_by_name(client, path, extra, param):
    body = dict(CMPL if path == "/v1/completions" else CHAT, **extra)
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"logit_bias": {}}),
    ("/v1/completions", {"logit_bias": {"1": 5, "49151": -100.0}}),
    ("/v1/completions", {"response_format": {"type": "json_object"}}),
    ("/v1/completions", {"response_format": {"type": "text"}}),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}),
    ("/v1/completions", {"best_of": 1, "temperature": 0, "top_p": 1}),   # ints for float fields are fine
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"n": 3, "best_of": 5}),
    ("/v1/completions", {"n": 2, "stream": True, "echo": True}),
    ("/v1/chat/completions", {"n": 16, "best_of": 16, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                              "user": "u-1", "seed": 3}),
])
def test_defaults_and_valid_types_pass_validation(client, path, extra):
    body = dict(CMPL if path == "/v1/completions" else CHAT, **extra)
    r = client.post(path, json=body)
    assert r.status_code == 503, r.text   # validated, then no worker to run it


@pytest.mark.parametrize("method, path, body, status", [
    ("POST", "/v1/completions", b"\x80", 400),                 # not UTF-8: was {"detail": ...}
    ("POST", "/v1/chat/completions", b'{"messages": "\xc3("}', 400),
    ("GET", "/v1/nope", None, 404),
    ("PUT", "/v1/completions", None, 405),
])
def test_framework_refusals_have_the_openai_error_body(client, method, path, body, status):
    r = client.request(method, path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if status == 400:
        assert err["message"].startswith("body") and err["type"] == "invalid_request_error"
