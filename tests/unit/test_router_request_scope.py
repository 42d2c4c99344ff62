"""The one exit path of a client request (router_svc/request_scope.py), as ``Dispatcher.generate``
and the fan-out of n samples use it: how the request ended becomes its counted status, its ids are
released, its admission ticket closed, its metrics given back; a clash on any id releases the ids
held so far. The paths through real streams are tests/unit/test_router_dispatch.py and
test_router_fanout_relay.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos import common_pb2, router_pb2
from router_svc.admission import Admission
from router_svc.dispatch import Dispatcher
from router_svc.errors import RouterError
from router_svc.policies import make_policy
from router_svc.pool import WorkerPool
from router_svc.request_scope import RequestScope
from router_svc.validation import prepare
from telemetry import metrics as M
from tests.unit.test_router_dispatch import tok  # noqa: F401


def _dispatcher(tok) -> Dispatcher:
    return Dispatcher(tok, WorkerPool(), make_policy("round_robin"), make_policy("round_robin"),
                      admission=Admission(max_queued=4))


def _prep(tok, request_id: str, text: str = "Hello"):
    return prepare(router_pb2.GenerateRequest(request_id=request_id, text=text,
                                              sampling=common_pb2.SamplingParams(max_tokens=4)), tok)


def _count(d: Dispatcher, status: str) -> float:
    return M.ROUTER_REQUESTS.labels(status=status, policy=d.policy_label, tenant="anonymous")._value.get()


async def _end_with(d: Dispatcher, prep, exc: BaseException | None, extra=()) -> RequestScope:
    ticket = d.admit(prep.tenant, 0.0)
    assert d.admission.queued == 1
    in_flight = M.ROUTER_IN_FLIGHT._value.get()
    scope = RequestScope(d, prep, ticket=ticket, extra_ids=extra)
    try:
        with scope:
            assert M.ROUTER_IN_FLIGHT._value.get() == in_flight + 1
            assert len(scope.waits) == 1 + len(extra) and not scope.abort_wait.done()
            if exc is not None:
                raise exc
            scope.handle.status = "ok"
    except BaseException as caught:   # noqa: B036: the scope passes every exception on
        assert caught is exc
    assert M.ROUTER_IN_FLIGHT._value.get() == in_flight
    assert d.admission.queued == 0
    await asyncio.gather(*scope.waits, return_exceptions=True)   # let the cancels land
    assert all(w.cancelled() for w in scope.waits)
    assert not d._inflight   # every id released
    return scope


@pytest.mark.parametrize("exc, status", [
    (None, "ok"),
    (RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed after 3 tokens"), "timeout"),
    (asyncio.CancelledError(), "cancelled"),
    (GeneratorExit(), "cancelled"),
    (RouterError(grpc.StatusCode.UNAVAILABLE, "no decode worker"), "error"),
])
def test_how_a_request_ends_is_its_counted_status(tok, exc, status):
    async def main():
        d = _dispatcher(tok)
        prep = _prep(tok, "r1", "Hello")
        before = _count(d, status)
        scope = await _end_with(d, prep, exc, extra=["r1#0", "r1#1"])
        assert scope.handle.status == status
        assert _count(d, status) == before + 1
    asyncio.run(main())


def test_a_clash_on_a_sample_id_releases_the_ids_held_and_closes_the_ticket(tok):
    async def main():
        d = _dispatcher(tok)
        prep = _prep(tok, "r2", "Hello")
        d.reserve(prep.tenant, "r2#1")   # another request runs with that id
        ticket = d.admit(prep.tenant, 0.0)
        errors = _count(d, "error")
        with pytest.raises(RouterError) as err:
            with RequestScope(d, prep, ticket=ticket, extra_ids=["r2#0", "r2#1"]):
                pytest.fail("entered a scope whose id is already running")
        assert err.value.code == grpc.StatusCode.ALREADY_EXISTS and "r2#1" in str(err.value)
        assert set(d._inflight) == {(prep.tenant, "r2#1")}   # r2 and r2#0 released, the other kept
        assert d.admission.queued == 0
        assert _count(d, "error") == errors   # refused, not counted as a request that ran
    asyncio.run(main())


def test_aborted_before_the_first_token_answers_abort_with_the_prompt_usage(tok):
    async def main():
        d = _dispatcher(tok)
        prep = _prep(tok, "r3", "Hello there")
        before = _count(d, "cancelled")
        with RequestScope(d, prep) as scope:
            resp = scope.aborted_early()
        assert (resp.request_id, resp.finish_reason) == ("r3", "abort")
        assert resp.usage.prompt_tokens == len(prep.input_ids) > 0 and not resp.token_ids
        assert _count(d, "cancelled") == before + 1
    asyncio.run(main())
