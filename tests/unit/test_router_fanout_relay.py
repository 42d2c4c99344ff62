"""The fan-out of n samples as one PD request (router_svc/fanout.py) against scripted in-process
workers (the real P/D run in tests/e2e/test_openai_n.py): n goes to both legs of one room, D's
chunks are demultiplexed by index into choices with their own usage (the prompt's pages counted
once), ``Router.Abort(<id>#<i>)`` reaches D as ``AbortRequest.sample``, and a D failing after tokens
were sent fails the request instead of migrating it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos import common_pb2, decode_pb2, router_pb2
from router_svc.errors import RouterError
from router_svc.fanout import generate_n
from router_svc.validation import prepare
from router_svc.dispatch import Dispatcher
from router_svc.policies import make_policy
from router_svc.pool import WorkerPool
from tests.unit.test_router_dispatch import ScriptedWorker, _prefilled, run, start, teardown, tok  # noqa: F401


class ForkingD(ScriptedWorker):
    """A D that streams ``request.n`` samples on one stream: sample i's tokens are the script's
    shifted by i; mode "die_after_first" fails once every sample sent its first token, "slow"
    keeps sample 1 running until it is aborted."""

    async def Generate(self, request, context):
        self.calls.append(request.room)
        self.requests.append(request)
        await _prefilled(request.room).wait()
        n = request.n
        for i in range(n):
            yield decode_pb2.DecodeChunk(token_ids=[self.tokens[0] + i], index=i, prompt_tokens=len(request.input_ids),
                                         kv_pages_transferred=3 if i == 0 else 0)
        if self.mode == "die_after_first":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode crashed")
        for i in range(n):
            if self.mode == "slow" and i == 1:
                while not any(a == (request.request_id, request.room, 1) for a in self.aborts):
                    await asyncio.sleep(0.02)
                yield decode_pb2.DecodeChunk(index=1, finish_reason="abort", completion_tokens=1)
                continue
            yield decode_pb2.DecodeChunk(token_ids=[t + i for t in self.tokens[1:]], index=i, finish_reason="length",
                                         completion_tokens=len(self.tokens))

    async def Abort(self, request, context):
        self.aborts.append((request.request_id, request.room, request.sample if request.HasField("sample") else None))
        return common_pb2.AbortResponse(found=True)


class RecordingP(ScriptedWorker):
    async def Prefill(self, request, context):
        self.requests.append(request)
        return await super().Prefill(request, context)


async def _setup(tok, d_mode="ok", n=2):
    tokens = tok.encode(" world, how are you")
    ws, servers, pool = {}, [], WorkerPool()
    for name, w in (("p0", RecordingP(tokens)), ("d0", ForkingD(tokens, d_mode)), ("d1", ForkingD(tokens, d_mode))):
        role = "prefill" if name.startswith("p") else "decode"
        server, addr = await start(w, role)
        servers.append(server)
        ws[name] = w
        pool.add(name, role, addr).healthy = True
    d = Dispatcher(tok, pool, make_policy("round_robin"), make_policy("round_robin"))
    prep = prepare(router_pb2.GenerateRequest(request_id="fan", text="Hello there", n=n,
                                              sampling=common_pb2.SamplingParams(max_tokens=8)), tok)
    return d, prep, ws, servers, tokens


def test_one_pd_request_carries_n_and_chunks_become_choices(tok):
    async def main():
        d, prep, ws, servers, tokens = await _setup(tok)
        out = [(i, r) async for i, r in generate_n(d, prep)]
        await teardown(d, servers)
        return out, ws, tokens, len(prep.input_ids)

    out, ws, tokens, prompt_len = run(main())
    (preq,) = ws["p0"].requests
    dreqs = ws["d0"].requests + ws["d1"].requests
    assert len(dreqs) == 1 and dreqs[0].n == preq.n == 2 and dreqs[0].room == preq.room   # one prefill
    by = {i: [r for j, r in out if j == i] for i in (0, 1)}
    for i in (0, 1):
        assert [t for r in by[i] for t in r.token_ids] == [t + i for t in tokens]
        assert by[i][-1].finish_reason == "length" and by[i][-1].request_id == "fan"
    assert by[0][-1].usage.kv_pages_transferred == 3 and by[1][-1].usage.kv_pages_transferred == 0
    assert all(u.usage.prompt_tokens == prompt_len for u in (by[0][-1], by[1][-1]))
    assert ws["d0"].aborts == ws["d1"].aborts == []


def test_abort_of_one_sample_reaches_d_as_abort_request_sample(tok):
    async def main():
        d, prep, ws, servers, tokens = await _setup(tok, "slow")
        out = []
        async for i, r in generate_n(d, prep):
            out.append((i, r))
            if len(out) == 2:   # both samples started
                assert d.abort("fan#1", "just this one")
        await teardown(d, servers)
        return out, ws

    out, ws = run(main())
    aborts = ws["d0"].aborts + ws["d1"].aborts
    assert [a[2] for a in aborts] == [1]
    finish = {i: r.finish_reason for i, r in out if r.finish_reason}
    assert finish == {0: "length", 1: "abort"}


def test_d_failing_after_tokens_is_unavailable_not_migrated(tok):
    async def main():
        d, prep, ws, servers, _ = await _setup(tok, "die_after_first")
        got = []
        with pytest.raises(RouterError) as ei:
            async for item in generate_n(d, prep):
                got.append(item)
        await teardown(d, servers)
        return ei.value, got, ws

    err, got, ws = run(main())
    assert err.code == grpc.StatusCode.UNAVAILABLE and "not migrated" in err.message and "n > 1" in err.message
    assert sorted(i for i, _ in got) == [0, 1]
    assert len(ws["d0"].requests + ws["d1"].requests) == 1   # no second pair
