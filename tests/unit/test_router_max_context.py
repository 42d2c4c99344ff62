"""The served context cap (``--max-context``, vLLM's ``--max-model-len``) on the router and the workers:
the card and /v1/models report it, the default max_tokens is the rest of it, longer requests are 400
``context_length_exceeded`` naming the field, a cap above the model's window or <= 0 stops the process
at start-up, and the router leaves out registry workers that serve a smaller cap."""

import argparse
import asyncio
import time

import grpc
import pytest
from fastapi.testclient import TestClient

from engine.config import served_context
from engine.model_store import resolve_model
from pd_common.worker_runtime import add_common_arguments, check_max_context
from protos import common_pb2, registry_pb2, registry_pb2_grpc, router_pb2
from router_svc import main as router_main
from router_svc.dispatch import Dispatcher
from router_svc.errors import RouterError
from router_svc.openai_api import build_app
from router_svc.policies import NoWorkerError, make_policy
from router_svc.pool import WorkerPool
from router_svc.tokenizer import RouterTokenizer
from router_svc.validation import prepare
from transfer_svc.digest import descriptor_digest

MODEL = "smollm2-135m-instruct"
CAP = 1024
WINDOW = 8192  # SmolLM2's max_position_embeddings


@pytest.fixture(scope="module")
def tok():
    return RouterTokenizer(MODEL, resolve_model(MODEL), max_context=CAP)


def _chat(text: str) -> router_pb2.ChatMessages:
    return router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content=text)])


def test_card_and_default_max_tokens_use_the_cap(tok):
    assert tok.card.max_context == CAP
    assert RouterTokenizer(MODEL, resolve_model(MODEL)).card.max_context == WINDOW  # no cap: the model's
    p = prepare(router_pb2.GenerateRequest(chat=_chat("Hi")), tok, default_max_tokens=None)
    assert p.sampling.max_tokens == CAP - len(p.input_ids)  # "the rest of the context" is the rest of the cap
    p = prepare(router_pb2.GenerateRequest(text="Hi", sampling=common_pb2.SamplingParams(max_tokens=CAP - 1)), tok)
    assert p.sampling.max_tokens == CAP - 1


@pytest.mark.parametrize("field, kw", [
    ("prompt", {"token_ids": router_pb2.TokenIds(ids=[5] * CAP)}),
    ("max_tokens", {"text": "Hi", "sampling": common_pb2.SamplingParams(max_tokens=CAP)}),
], ids=["prompt", "max_tokens"])
def test_past_the_cap_is_context_length_exceeded(tok, field, kw):
    with pytest.raises(RouterError) as ei:
        prepare(router_pb2.GenerateRequest(**kw), tok)
    e = ei.value
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and e.param == field
    assert e.err_code == "context_length_exceeded" and f"{CAP} tokens" in e.message


def test_http_models_and_400(tok):
    d = Dispatcher(tok, WorkerPool(max_context=CAP), make_policy("round_robin"), make_policy("round_robin"))
    with TestClient(build_app(d)) as c:
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == CAP
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": CAP})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x " * CAP}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("cap, message", [(0, "must be > 0"), (-3, "must be > 0"),
                                          (WINDOW + 1, f"above the model's context window of {WINDOW} tokens")])
def test_bad_cap_is_refused(cap, message):
    with pytest.raises(ValueError, match=message):
        served_context(cap, WINDOW)
    with pytest.raises(ValueError, match=message):
        RouterTokenizer(MODEL, resolve_model(MODEL), max_context=cap)
    assert served_context(None, WINDOW) == WINDOW and served_context(WINDOW, WINDOW) == WINDOW


def test_router_start_refuses_a_cap_above_the_window():
    """serve-router stops with one line naming the flag, before it binds anything."""
    p = argparse.ArgumentParser()
    router_main.add_arguments(p)
    args = p.parse_args(["--max-context", str(WINDOW * 2), "--registry", "127.0.0.1:1", "--port", "0",
                         "--http-port", "0"])
    with pytest.raises(SystemExit) as ei:
        asyncio.run(router_main.serve(args))
    assert str(ei.value) == f"serve-router: --max-context {WINDOW * 2} is above the model's context window " \
                            f"of {WINDOW} tokens"


def test_worker_start_refuses_a_bad_cap(capsys):
    p = argparse.ArgumentParser()
    add_common_arguments(p, "decode")
    with pytest.raises(SystemExit):
        p.parse_args(["--max-context", "0"])
    assert "--max-context" in capsys.readouterr().err
    args = p.parse_args(["--model", MODEL, "--max-context", str(WINDOW + 16)])
    with pytest.raises(SystemExit) as ei:
        check_max_context(args)
    assert str(ei.value) == f"error: --max-context {WINDOW + 16} is above the model's context window of {WINDOW} tokens"
    check_max_context(p.parse_args(["--model", MODEL, "--max-context", str(CAP)]))  # fits: no exit
    check_max_context(p.parse_args(["--model", "dummy-shape-nobody-has", "--load-format", "dummy",
                                    "--max-context", "9"]))  # unknown model: the loader names it later


def _record(worker_id: str, role, cap: int) -> registry_pb2.WorkerRecord:
    seg = registry_pb2.SegmentDescriptor(name=worker_id, incarnation="i1", worker_address=b"ucx",
                                         kv_layout=registry_pb2.KVLayout(layout="page_major", page_size=16,
                                                                         model=MODEL, max_context=cap))
    seg.digest = descriptor_digest(seg)
    return registry_pb2.WorkerRecord(worker_id=worker_id, role=role, grpc_address="127.0.0.1:1",
                                     model=MODEL, segment=seg)


def test_pool_leaves_out_workers_with_a_smaller_cap():
    """Through the real registry: a decode worker published with --max-context 512 under a router
    serving 1024 is not used (it would refuse the router's requests); 1024 and unknown (0) are."""
    from transfer_svc.registry import serve

    server, _, port = serve(port=0)
    try:
        stub = registry_pb2_grpc.RegistryStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        for wid, role, cap in (("d-small", registry_pb2.DECODE, 512), ("d-same", registry_pb2.DECODE, CAP),
                               ("p-unknown", registry_pb2.PREFILL, 0)):
            stub.RegisterSegment(registry_pb2.RegisterSegmentRequest(worker=_record(wid, role, cap), ttl_seconds=60))

        async def watch() -> WorkerPool:
            pool = WorkerPool(model_names=(MODEL,), max_context=CAP, health_interval=60)
            pool.watch_registry(f"127.0.0.1:{port}")
            deadline = time.monotonic() + 10
            while (len(pool.workers) < 2 or "d-small" not in pool.left_out) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            seen, left = set(pool.workers), dict(pool.left_out)
            with pytest.raises(NoWorkerError) as ei:  # nothing is healthy (no process behind the records)
                pool.pick_pair(make_policy("round_robin"), make_policy("round_robin"), [1, 2])
            await pool.close()
            return seen, left, str(ei.value)

        seen, left, err = asyncio.run(watch())
    finally:
        server.stop(0)
    assert seen == {"d-same", "p-unknown"}
    assert set(left) == {"d-small"} and "--max-context 512 is below the router's 1024" in left["d-small"]
    assert "d-small" in err and "--max-context 512" in err  # the 503 says why a registered worker is not used
