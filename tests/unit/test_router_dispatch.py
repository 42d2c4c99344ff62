"""Dispatcher control flow against scripted in-process gRPC workers (the real P/D run in tests/e2e):
concurrent legs, retry on a new pair with a new room, Abort to both legs, no retry on client errors,
a mid-stream decode failure as UNAVAILABLE, Router.Abort, and a router-side stop string.

A scripted D yields its first token only after a scripted P answered for the same room, as a real D
does (otherwise a failing P could lose the race to D's first token and the test would be flaky)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from engine.model_store import resolve_model
from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, router_pb2
from router_svc.dispatch import Dispatcher
from router_svc.errors import RouterError
from router_svc.policies import make_policy
from router_svc.pool import WorkerPool
from router_svc.tokenizer import RouterTokenizer
from router_svc.validation import prepare

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tok():
    return RouterTokenizer(MODEL, resolve_model(MODEL))


_PREFILLED: dict[int, asyncio.Event] = {}   # room -> set once a prefill leg answered ok for it


def _prefilled(room: int) -> asyncio.Event:
    return _PREFILLED.setdefault(room, asyncio.Event())


class ScriptedWorker(prefill_pb2_grpc.PrefillServicer, decode_pb2_grpc.DecodeServicer):
    """mode: "ok" | "unavailable" | "invalid" | "die_after_first" | "drain_after_first" | "slow" (tokens
    every 50 ms, forever)."""

    def __init__(self, tokens: list[int], mode: str = "ok") -> None:
        self.tokens, self.mode = tokens, mode
        self.calls: list[int] = []        # rooms seen
        self.requests: list = []          # DecodeRequests seen
        self.aborts: list[tuple[str, int]] = []

    async def Prefill(self, request, context):
        self.calls.append(request.room)
        if self.mode == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill down")
        _prefilled(request.room).set()
        return prefill_pb2.PrefillResult(room=request.room, first_token_id=self.tokens[0], cached_tokens=0,
                                         pages_sent=1, bytes_sent=4096)

    def _sent(self, input_ids) -> int:
        """Tokens of the script a migrated request already carries at the end of its prompt."""
        for k in range(min(len(input_ids), len(self.tokens)), 0, -1):
            if list(input_ids[-k:]) == self.tokens[:k]:
                return k
        return 0

    async def Generate(self, request, context):
        self.calls.append(request.room)
        self.requests.append(request)
        tokens = self.tokens[self._sent(request.input_ids):]   # a migrated stream goes on from there
        if self.mode == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode down")
        if self.mode == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: too many")
        # like a real D: the first token exists only once P has prefilled this room
        await _prefilled(request.room).wait()
        yield decode_pb2.DecodeChunk(token_ids=tokens[:1], prompt_tokens=len(request.input_ids))
        if self.mode == "die_after_first":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode crashed")
        if self.mode == "drain_after_first":   # what a draining D ends its streams with
            context.set_trailing_metadata((("halfmoon-migrate", "drain"),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker draining")
        if self.mode == "slow":
            while True:
                await asyncio.sleep(0.05)
                yield decode_pb2.DecodeChunk(token_ids=self.tokens[1:2])
        # the rest in one chunk, as a D whose stream lagged sends it (decode_svc.streams)
        yield decode_pb2.DecodeChunk(token_ids=tokens[1:], finish_reason="length",
                                     logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=-0.5)
                                               for t in tokens[1:]],
                                     completion_tokens=len(tokens), kv_pages_transferred=1,
                                     kv_bytes_transferred=4096)

    async def Abort(self, request, context):
        self.aborts.append((request.request_id, request.room))
        return common_pb2.AbortResponse(found=True)

    async def GetLoad(self, request, context):
        return common_pb2.LoadReport()


async def start(worker: ScriptedWorker, role: str):
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)  # SERVING by default
    (prefill_pb2_grpc.add_PrefillServicer_to_server if role == "prefill"
     else decode_pb2_grpc.add_DecodeServicer_to_server)(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def setup(tok, modes: dict[str, str], text="Hello there", **dispatcher_kw):
    tokens = tok.encode(" world, how are you")
    workers, servers = {}, []
    pool = WorkerPool()
    for name, mode in modes.items():
        role = "prefill" if name.startswith("p") else "decode"
        w = ScriptedWorker(tokens, mode)
        server, addr = await start(w, role)
        servers.append(server)
        workers[name] = w
        pool.add(name, role, addr).healthy = True
    d = Dispatcher(tok, pool, make_policy("round_robin"), make_policy("round_robin"), **dispatcher_kw)
    prep = prepare(router_pb2.GenerateRequest(text=text, sampling=common_pb2.SamplingParams(max_tokens=8)), tok)
    return d, prep, workers, servers, tokens


async def teardown(d, servers):
    # the background Abort calls land (a fixed sleep lost this race on a loaded machine)
    if d._background:
        await asyncio.wait(set(d._background), timeout=10)
    await d.pool.close()
    for s in servers:
        await s.stop(None)


async def collect(d, prep, **kw):
    return [r async for r in d.generate(prep, **kw)]


def test_ok_path_streams_text_and_usage(tok):
    async def main():
        d, prep, ws, servers, tokens = await setup(tok, {"p0": "ok", "d0": "ok"})
        out = await collect(d, prep)
        await teardown(d, servers)
        return out, ws, tokens

    out, ws, tokens = run(main())
    assert [t for r in out for t in r.token_ids] == tokens
    assert "".join(r.text for r in out) == tok.hf.decode(tokens)
    last = out[-1]
    assert last.finish_reason == "length" and last.usage.prompt_tokens == len(tok.encode("Hello there"))
    assert last.usage.retries == 0 and last.usage.kv_bytes_transferred == 4096
    assert ws["p0"].calls == ws["d0"].calls and 0 < ws["p0"].calls[0] < 2**63   # same room to both legs
    assert ws["p0"].aborts == [] and ws["d0"].aborts == []                      # a clean finish aborts nothing


@pytest.mark.parametrize("failing", ["p0", "d0"])
def test_leg_failure_before_first_token_retries_on_other_pair_with_new_room(tok, failing):
    async def main():
        modes = {"p0": "ok", "p1": "ok", "d0": "ok", "d1": "ok", failing: "unavailable"}
        d, prep, ws, servers, tokens = await setup(tok, modes)
        out = await collect(d, prep)
        health = {w.worker_id: w.healthy for w in d.pool.workers.values()}
        await teardown(d, servers)
        return out, ws, tokens, health

    out, ws, tokens, health = run(main())
    assert [t for r in out for t in r.token_ids] == tokens
    last = out[-1]
    assert last.usage.retries == 1 and (last.prefill_worker, last.decode_worker) == ("p1", "d1")
    first_room = ws[failing].calls[0]   # the failing leg answered, so its worker saw the room
    # its partner's call is cancelled when it fails: whether that call had reached the worker by
    # then is a race (a fast UNAVAILABLE wins it); the Abort below reaches the worker either way
    partner = {"p0": "d0", "d0": "p0"}[failing]
    assert ws[partner].calls in ([], [first_room])
    assert ws["p1"].calls == ws["d1"].calls and ws["p1"].calls[0] != first_room     # a new room
    rid = last.request_id
    assert (rid, first_room) in ws["d0"].aborts and (rid, first_room) in ws["p0"].aborts
    assert health[failing] is True   # its health check still passes (probed): not marked down, only avoided


def test_client_error_from_a_worker_is_not_retried(tok):
    async def main():
        d, prep, ws, servers, _ = await setup(tok, {"p0": "ok", "p1": "ok", "d0": "invalid", "d1": "ok"})
        with pytest.raises(RouterError) as ei:
            await collect(d, prep)
        await teardown(d, servers)
        return ei.value, ws

    err, ws = run(main())
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in err.message
    assert ws["d1"].calls == [] and ws["p1"].calls == []


def test_decode_failure_after_first_token_is_unavailable_naming_the_worker(tok):
    async def main():
        d, prep, ws, servers, _ = await setup(tok, {"p0": "ok", "d0": "die_after_first"}, migration_limit=0)
        got = []
        with pytest.raises(RouterError) as ei:
            async for r in d.generate(prep):
                got.append(r)
        await teardown(d, servers)
        return ei.value, got, ws

    err, got, ws = run(main())
    assert len(got) == 1 and got[0].token_ids
    assert err.code == grpc.StatusCode.UNAVAILABLE and "d0" in err.message and "after 1 tokens" in err.message
    assert "--migration-limit 0" in err.message
    assert len(ws["d0"].calls) == 1   # never retried once tokens were sent (migration off)


def test_router_abort_ends_stream_and_aborts_both_legs(tok):
    async def main():
        d, prep, ws, servers, _ = await setup(tok, {"p0": "ok", "d0": "slow"})
        out = []
        async for r in d.generate(prep):
            out.append(r)
            if len(out) == 3:
                assert d.abort(prep.request_id)
        await teardown(d, servers)
        return out, ws

    out, ws = run(main())
    assert out[-1].finish_reason == "abort" and out[-1].usage.completion_tokens == 3
    room = ws["d0"].calls[0]
    assert ws["d0"].aborts == [(out[-1].request_id, room)] and ws["p0"].aborts == [(out[-1].request_id, room)]


def test_client_cancel_aborts_both_legs(tok):
    async def main():
        d, prep, ws, servers, _ = await setup(tok, {"p0": "ok", "d0": "slow"})

        async def consume():
            async for _ in d.generate(prep):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        inflight = [w.inflight for w in d.pool.workers.values()]
        await teardown(d, servers)
        return ws, inflight

    ws, inflight = run(main())
    room = ws["d0"].calls[0]
    assert [r for _, r in ws["d0"].aborts] == [room] and [r for _, r in ws["p0"].aborts] == [room]
    assert inflight == [0, 0]


def test_stop_string_seen_by_router_stops_decode(tok):
    async def main():
        d, prep, ws, servers, tokens = await setup(tok, {"p0": "ok", "d0": "slow"})
        prep.stop = [tok.hf.decode(tokens[1:2]).strip()]   # the token "slow" repeats forever
        out = await collect(d, prep)
        await teardown(d, servers)
        return out, ws, prep.stop[0]

    out, ws, stop = run(main())
    assert out[-1].finish_reason == "stop" and out[-1].matched_stop == stop
    assert stop not in "".join(r.text for r in out)
    assert len(ws["d0"].aborts) == 1   # D was still running: the router aborted it


def test_stop_string_inside_a_multi_token_chunk_cuts_tokens_logprobs_and_usage(tok):
    async def main():
        d, prep, ws, servers, tokens = await setup(tok, {"p0": "ok", "d0": "ok"})
        prep.stop = ["how"]   # completed by tokens[2], in the middle of D's second (last) chunk
        out = await collect(d, prep)
        await teardown(d, servers)
        return out, tokens

    out, tokens = run(main())
    assert tok.hf.decode(tokens[:3]).endswith("how") and not tok.hf.decode(tokens[:2]).endswith("how")
    assert [t for r in out for t in r.token_ids] == tokens[:3]       # nothing past the stop string
    assert [lp.token_id for r in out for lp in r.logprobs] == tokens[1:3]
    last = out[-1]
    assert last.finish_reason == "stop" and last.matched_stop == "how"
    assert last.usage.completion_tokens == 3 and "how" not in "".join(r.text for r in out)


def test_pool_health_down_at_once_when_gone_after_three_timeouts_when_slow():
    from router_svc.worker import Worker

    async def main():
        pool = WorkerPool(max_timeouts=3)
        w = Worker("d0", "decode", "127.0.0.1:1", healthy=True)
        for _ in range(2):
            pool._record(w, None)           # slow answers: a busy worker
        assert w.healthy
        pool._record(w, None)
        assert not w.healthy and "timed out" in w.last_error
        pool._record(w, True)
        assert w.healthy and w.failures == 0
        pool._record(w, False)              # refused / NOT_SERVING: down at once
        assert not w.healthy
        assert make_policy("least_load").pick([w, Worker("d1", "decode", "x", healthy=True)], [1]).worker_id == "d1"

    run(main())


def test_pool_marks_not_serving_and_unreachable_workers_down(tok):
    async def main():
        d, prep, ws, servers, _ = await setup(tok, {"p0": "ok", "d0": "ok"})
        closed = WorkerPool()
        w = closed.add("gone", "decode", "127.0.0.1:1")   # nothing listens there
        w.healthy = True
        assert not await closed.probe(w) and not w.healthy
        await closed.close()
        await servers[1].stop(None)                         # d0's server goes away
        d0 = d.pool.workers["d0"]
        for _ in range(40):
            if not d0.healthy:
                break
            await asyncio.sleep(0.1)
        healthy = d0.healthy
        await teardown(d, servers)
        return healthy

    assert run(main()) is False   # connection refused: down at the next periodic check


def test_both_legs_failing_in_one_wait_log_no_unretrieved_task_exception(tok):
    """P refusing a pair (e.g. FAILED_PRECONDITION for a --kv-layout mismatch) and D's UNAVAILABLE
    "prefill failed" can complete in the same wait. The attempt fails on P's error; D's exception must
    be retrieved as well, else asyncio logs "Task exception was never retrieved" with a traceback in
    the router log for every such request."""
    import gc
    import time

    from router_svc.legs import LegFailure as _LegFailure

    def rpc_error(code, details):
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)

    async def main():
        loop = asyncio.get_running_loop()
        unretrieved = []
        loop.set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx.get("message")))
        pool = WorkerPool()
        p, d = pool.add("p0", "prefill", "127.0.0.1:1"), pool.add("d0", "decode", "127.0.0.1:2")
        disp = Dispatcher(tok, pool, make_policy("round_robin"), make_policy("round_robin"))

        def failed(code, details):
            f = loop.create_future()
            f.set_exception(rpc_error(code, details))
            return f

        class Legs:  # both legs already failed when the dispatcher first waits on them
            p_result = None

            def __init__(self):
                self.p, self.d = p, d
                self.p_task = failed(grpc.StatusCode.FAILED_PRECONDITION, "need the same --kv-layout")

            def read(self):
                return failed(grpc.StatusCode.UNAVAILABLE, "prefill failed: need the same --kv-layout")

        abort_wait = loop.create_future()
        failure = None
        try:
            await disp.attempts.first_chunk(Legs(), abort_wait, time.monotonic() + 5)
        except _LegFailure as e:
            failure = (e.leg, e.code)
        abort_wait.cancel()
        gc.collect()
        await asyncio.sleep(0)
        await pool.close()
        return failure, unretrieved

    failure, unretrieved = run(main())
    assert failure == ("prefill", grpc.StatusCode.FAILED_PRECONDITION)
    assert unretrieved == []
