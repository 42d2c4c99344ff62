"""Stream migration in the router (router_svc/migration.py) against scripted in-process workers
(tests/unit/test_router_dispatch.py's ``ScriptedWorker``; the real P/D run in
tests/e2e/test_router_migration.py): a decode worker that dies after its first token is replaced
by another pair that gets prompt + the tokens sent, the client's stream goes on with every token
once, and the limit and the requests that cannot move end with UNAVAILABLE saying why."""

from __future__ import annotations

import grpc
import pytest

from protos import common_pb2, router_pb2
from router_svc.errors import RouterError
from router_svc.migration import StreamState
from router_svc.validation import prepare
from tests.unit.test_router_dispatch import run, setup, teardown, tok  # noqa: F401 (fixture)


async def _stream(d, prep):
    got, err = [], None
    try:
        async for r in d.generate(prep):
            got.append(r)
    except RouterError as e:
        err = e
    return got, err


def _order_decodes(d, first: str) -> None:
    """Round robin over the decode workers starts at ``first``."""
    ws = d.pool.workers
    d.pool.workers = {first: ws[first], **{k: v for k, v in ws.items() if k != first}}


def test_decode_death_mid_stream_continues_on_another_pair(tok):
    async def main():
        d, prep, ws, servers, tokens = await setup(tok, {"p0": "ok", "d0": "die_after_first", "d1": "ok"},
                                                   migration_limit=1)
        _order_decodes(d, "d0")
        got, err = await _stream(d, prep)
        await teardown(d, servers)
        return got, err, ws, tokens, prep

    got, err, ws, tokens, prep = run(main())
    assert err is None
    assert [t for r in got for t in r.token_ids] == tokens            # every token once, in order
    assert "".join(r.text for r in got) == tok.hf.decode(tokens)
    assert got[0].decode_worker == "d0" and got[-1].decode_worker == "d1"
    moved = ws["d1"].requests[0]
    assert list(moved.input_ids) == prep.input_ids + tokens[:1]       # prompt + the token sent
    assert moved.sampling.max_tokens == prep.sampling.max_tokens - 1
    assert moved.room != ws["d0"].requests[0].room                     # a new room
    u = got[-1].usage
    assert got[-1].finish_reason == "length"
    assert u.prompt_tokens == len(prep.input_ids) and u.completion_tokens == len(tokens)
    assert u.migrations == 1 and u.retries == 0
    assert u.kv_bytes_transferred == 2 * 4096                          # both pairs' transfers
    room0 = ws["d0"].requests[0].room
    assert any(r == room0 for _, r in ws["p0"].aborts)                 # the left pair was aborted


def test_a_draining_decode_workers_hand_back_migrates_counted_as_drain(tok):
    from telemetry import metrics as M

    def count(reason):
        return M.ROUTER_MIGRATIONS.labels(reason=reason)._value.get()

    async def main():
        d, prep, ws, servers, tokens = await setup(tok, {"p0": "ok", "d0": "drain_after_first", "d1": "ok"},
                                                   migration_limit=1)
        _order_decodes(d, "d0")
        before = count("drain"), count("failure")
        got, err = await _stream(d, prep)
        after = count("drain"), count("failure")
        await teardown(d, servers)
        return got, err, tokens, before, after

    got, err, tokens, before, after = run(main())
    assert err is None and [t for r in got for t in r.token_ids] == tokens
    assert after == (before[0] + 1, before[1])


def test_beyond_the_limit_ends_unavailable_naming_it(tok):
    async def main():
        d, prep, ws, servers, _ = await setup(
            tok, {"p0": "ok", "d0": "die_after_first", "d1": "die_after_first"}, migration_limit=1)
        got, err = await _stream(d, prep)
        await teardown(d, servers)
        return got, err, ws

    got, err, ws = run(main())
    assert [len(r.token_ids) for r in got] == [1, 1]                   # one token from each pair
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "--migration-limit 1 reached" in err.message and "after 2 tokens" in err.message
    assert len(ws["d0"].requests) + len(ws["d1"].requests) == 2


def _prep(tok, **sampling):
    return prepare(router_pb2.GenerateRequest(text="Hello there", sampling=common_pb2.SamplingParams(
        max_tokens=8, **sampling)), tok)


@pytest.mark.parametrize("sampling, word", [
    (dict(structured=common_pb2.StructuredOutput(json_object=True)), "structured"),
    (dict(frequency_penalty=0.5), "frequency_penalty"),
    (dict(presence_penalty=0.5), "presence_penalty"),
])
def test_requests_whose_state_cannot_move_are_not_migrated(tok, sampling, word):
    st = StreamState(_prep(tok, **sampling), limit=3)
    assert word in st.refusal(grpc.StatusCode.UNAVAILABLE)


def test_worker_errors_a_new_pair_would_repeat_are_not_migrated(tok):
    st = StreamState(_prep(tok), limit=3)
    assert st.refusal(grpc.StatusCode.UNAVAILABLE) == ""
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
        assert code.name in st.refusal(code)


def test_seeded_and_repetition_penalised_requests_migrate_with_their_knobs(tok):
    prep = _prep(tok, temperature=0.8, seed=7, repetition_penalty=1.3, stop=["zz"])
    st = StreamState(prep, limit=1)
    st.generated = [11, 12, 13]
    assert st.refusal(grpc.StatusCode.UNAVAILABLE) == ""
    cont = st.continuation()
    assert cont.input_ids == prep.input_ids + [11, 12, 13] and cont.sampling.max_tokens == 5
    assert cont.sampling.seed == 7 and list(cont.sampling.stop) == ["zz"]
    assert cont.sampling.repetition_penalty == pytest.approx(1.3)
    assert prep.sampling.max_tokens == 8 and len(prep.input_ids) == len(cont.input_ids) - 3   # untouched


def test_usage_takes_ds_transfer_numbers_and_ps_only_when_d_sent_none(tok):
    """D reports the KV it received on its last chunk; P's PrefillResult fills in only what D left at 0
    (a D that finished before the router read P's answer must not lose its bytes, and vice versa)."""
    from protos import decode_pb2, prefill_pb2
    p = prefill_pb2.PrefillResult(cached_tokens=3, pages_sent=2, bytes_sent=8192)
    st = StreamState(_prep(tok), limit=1)
    st.add(decode_pb2.DecodeChunk(token_ids=[5], finish_reason="length", kv_pages_transferred=1,
                                  kv_bytes_transferred=4096))
    u = st.finish(None)
    assert (u.kv_pages_transferred, u.kv_bytes_transferred, u.completion_tokens) == (1, 4096, 1)
    st = StreamState(_prep(tok), limit=1)
    st.add(decode_pb2.DecodeChunk(token_ids=[5], finish_reason="length"))
    u = st.finish(p)
    assert (u.kv_pages_transferred, u.kv_bytes_transferred, u.cached_tokens) == (2, 8192, 2)
