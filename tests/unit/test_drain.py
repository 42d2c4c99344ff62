"""``pd_common.drain.Drain``: the running-call count a worker's SIGTERM waits on (the drain end to
end, with real processes: tests/e2e/test_router_migration.py)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pd_common.drain import MIGRATE_DRAIN, MIGRATE_KEY, Drain


class _Aborted(Exception):
    pass


class _Context:
    """What a servicer context does on abort: remember the status and raise."""

    def __init__(self):
        self.trailing, self.status = (), None

    def set_trailing_metadata(self, md):
        self.trailing = md

    def abort(self, code, details):
        self.status = (code, details)
        raise _Aborted


def test_new_calls_are_refused_only_once_draining():
    d, ctx = Drain("decode", 1.0), _Context()
    d.refuse_new(ctx)
    assert ctx.status is None
    d.begin()
    with pytest.raises(_Aborted):
        d.refuse_new(ctx)
    assert ctx.status[0] == grpc.StatusCode.UNAVAILABLE and "draining" in ctx.status[1]


def test_wait_idle_returns_when_the_last_call_ends_or_the_grace_passes():
    d = Drain("decode", 5.0)
    release = threading.Event()

    def call():
        with d.track():
            release.wait(10)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    while d.active < 3:
        time.sleep(0.01)
    t0 = time.monotonic()
    assert d.wait_idle(0.3) == 3 and time.monotonic() - t0 >= 0.3     # grace over: 3 still run
    threading.Timer(0.2, release.set).start()
    t0 = time.monotonic()
    assert d.wait_idle(5.0) == 0 and time.monotonic() - t0 < 3        # back as soon as they end
    for t in threads:
        t.join()


def test_a_second_signal_cuts_the_grace_short():
    d = Drain("decode", 30.0)
    with d.track():
        threading.Timer(0.2, d.hurry.set).start()
        t0 = time.monotonic()
        assert d.wait_idle(30.0) == 1 and time.monotonic() - t0 < 5


def test_hand_back_is_unavailable_with_the_migrate_metadata():
    ctx = _Context()
    with pytest.raises(_Aborted):
        Drain.hand_back(ctx, "decode worker d0")
    assert ctx.trailing == ((MIGRATE_KEY, MIGRATE_DRAIN),)
    assert ctx.status[0] == grpc.StatusCode.UNAVAILABLE and "d0 is draining" in ctx.status[1]
