"""Validation before dispatch: bad input -> INVALID_ARGUMENT / HTTP 400 naming the field, with the
OpenAI error body; nothing reaches a worker (the pool here has none: a valid request gets 503)."""

import grpc
import pytest
from fastapi.testclient import TestClient

from engine.model_store import resolve_model
from protos import common_pb2, router_pb2
from router_svc.dispatch import Dispatcher
from router_svc.errors import RouterError
from router_svc.openai_api import build_app
from router_svc.policies import make_policy
from router_svc.pool import WorkerPool
from router_svc.tokenizer import RouterTokenizer
from router_svc.validation import prepare

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tok():
    return RouterTokenizer(MODEL, resolve_model(MODEL))


@pytest.fixture(scope="module")
def client(tok):
    d = Dispatcher(tok, WorkerPool(), make_policy("round_robin"), make_policy("round_robin"))
    with TestClient(build_app(d)) as c:
        yield c


def bad(tok, param, **kw):
    with pytest.raises(RouterError) as ei:
        prepare(router_pb2.GenerateRequest(**kw), tok)
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.param == param and ei.value.message.startswith(param)
    return ei.value


def test_prepare_ok_text_tokens_chat(tok):
    p = prepare(router_pb2.GenerateRequest(text="Hello there"), tok)
    assert p.input_ids == tok.encode("Hello there") and p.sampling.max_tokens == 16
    assert p.request_id.startswith("req-")
    p = prepare(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1, 2, 3]), request_id="x"), tok)
    assert p.input_ids == [1, 2, 3] and p.request_id == "x"
    chat = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="Hi")])
    p = prepare(router_pb2.GenerateRequest(chat=chat, model=MODEL), tok, default_max_tokens=None)
    assert tok.hf.decode(p.input_ids).endswith("<|im_start|>assistant\n")
    assert p.sampling.max_tokens == tok.card.max_context - len(p.input_ids)


def test_prepare_rejects(tok):
    S = common_pb2.SamplingParams
    bad(tok, "prompt")
    bad(tok, "prompt", text="")
    bad(tok, "prompt", token_ids=router_pb2.TokenIds(ids=[]))
    bad(tok, "prompt", token_ids=router_pb2.TokenIds(ids=[1, 10**7]))
    bad(tok, "messages", chat=router_pb2.ChatMessages())
    bad(tok, "messages", chat=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="wizard", content="x")]))
    assert bad(tok, "model", text="hi", model="gpt-9").err_code == "model_not_found"
    bad(tok, "max_tokens", text="hi", sampling=S(max_tokens=0))
    assert bad(tok, "max_tokens", text="hi", sampling=S(max_tokens=tok.card.max_context)).err_code \
        == "context_length_exceeded"
    bad(tok, "prompt", token_ids=router_pb2.TokenIds(ids=[5] * tok.card.max_context))
    bad(tok, "temperature", text="hi", sampling=S(temperature=-0.5))
    bad(tok, "temperature", text="hi", sampling=S(temperature=float("nan")))
    bad(tok, "top_p", text="hi", sampling=S(top_p=0.0))
    bad(tok, "top_k", text="hi", sampling=S(top_k=-2))
    bad(tok, "min_p", text="hi", sampling=S(min_p=1.5))
    bad(tok, "repetition_penalty", text="hi", sampling=S(repetition_penalty=0))
    bad(tok, "presence_penalty", text="hi", sampling=S(presence_penalty=3))
    bad(tok, "frequency_penalty", text="hi", sampling=S(frequency_penalty=-3))
    bad(tok, "top_logprobs", text="hi", sampling=S(top_logprobs=21))
    bad(tok, "stop", text="hi", sampling=S(stop=["ok", ""]))
    bad(tok, "stop_token_ids", text="hi", sampling=S(stop_token_ids=[-1]))


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, "model"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "seed": -4}, "seed"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 0}, "echo"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    # integers past the int32 proto fields: 400 naming the field, not a protobuf ValueError (500)
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**70}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**40}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**40]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [2**40]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2**70},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 2**40}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 9},
     "frequency_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
])
def test_http_400_names_the_field(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param in err["message"]


def test_valid_request_without_workers_is_503(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and "no healthy worker" in r.json()["error"]["message"]
    assert "no healthy prefill worker (0 registered)" in r.json()["error"]["message"]  # names the missing role
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"  # not a 200 + error event
    assert client.get("/health").status_code == 503


def test_duplicate_request_id_is_409_not_500():
    """ALREADY_EXISTS (a request_id that is still running) is the client's conflict, not a server error."""
    exc = RouterError(grpc.StatusCode.ALREADY_EXISTS, "request_id: 'a' is already running", "request_id")
    assert exc.http_status == 409
    assert exc.openai_body()["error"] == {"message": "request_id: 'a' is already running", "param": "request_id",
                                          "type": "invalid_request_error", "code": "already_exists"}


def test_models(client, tok):
    r = client.get("/v1/models").json()
    assert r["object"] == "list" and r["data"][0]["id"] == MODEL
    assert r["data"][0]["max_model_len"] == tok.card.max_context
