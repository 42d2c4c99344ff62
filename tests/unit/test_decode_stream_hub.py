"""decode_svc.stream_hub: the scheduler's stream items reach D's grpc.aio streams in one loop
wake-up per burst, and each stream sends what ``decode_svc.streams`` would (real loop, real
threads, real protos)."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from decode_svc.stream_hub import StreamHub, aio_stream_chunks
from decode_svc.streams import StreamEnd
from pd_common.protocol import ServiceError
from tests.unit.test_decode_streams import _per_token_run, _tok


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    th = threading.Thread(target=lp.run_forever, daemon=True)
    th.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    th.join(5)
    lp.close()


def _on(loop, coro, timeout=10):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


async def _collect(inbox, **kw):
    return [c async for c in aio_stream_chunks(inbox, **kw)]


def test_a_step_burst_wakes_the_loop_once_and_every_stream_gets_its_tokens(loop):
    """256 streams, 3 steps of one token each put from another thread while the loop is busy: the
    loop is woken once per burst (not once per token), each stream sends its 3 tokens in order."""
    hub = StreamHub(loop)
    wakes = []
    real = loop.call_soon_threadsafe

    def counting(cb, *a, **kw):  # the real call, counted
        wakes.append(cb)
        return real(cb, *a, **kw)

    loop.call_soon_threadsafe = counting
    n = 256
    inboxes = _on(loop, _make(hub, n))
    tasks = [asyncio.run_coroutine_threadsafe(_collect(ib, keepalive_s=0, queued=lambda: False), loop)
             for ib in inboxes]
    real(time.sleep, 0.3)  # the loop is busy while the scheduler thread puts a burst
    wakes.clear()
    for step in range(3):
        for ib in inboxes:
            ib.put(_tok(10 + step, finish_reason="length" if step == 2 else ""))
    for ib in inboxes:
        ib.put(None)
    got = [t.result(10) for t in tasks]
    assert len(wakes) == 1
    for chunks in got:
        assert [t for c in chunks for t in c.token_ids] == [10, 11, 12]
        assert chunks[-1].finish_reason == "length"
        assert len(chunks) == 1  # all three were waiting when the stream woke: one message


async def _make(hub, n):
    return [hub.inbox() for _ in range(n)]


def test_off_sends_one_chunk_per_token_and_errors_after_tokens(loop):
    hub = StreamHub(loop)
    a, b = _on(loop, _make(hub, 2))
    for c in _per_token_run():
        a.put(c)
    a.put(None)
    got = _on(loop, _collect(a, keepalive_s=0, queued=lambda: True, coalesce=False))
    assert [list(c.token_ids) for c in got] == [[5], [6], [7], [8]]
    err = ServiceError(grpc.StatusCode.CANCELLED, "aborted: client gone")
    for it in (_tok(1), _tok(2), err):
        b.put(it)

    async def read_b():
        it = aio_stream_chunks(b, keepalive_s=0, queued=lambda: True)
        first = await it.__anext__()
        with pytest.raises(StreamEnd) as e:
            await it.__anext__()
        return first, e.value.error

    first, e = _on(loop, read_b())
    assert list(first.token_ids) == [1, 2] and e is err


def test_keepalives_only_before_the_first_token(loop):
    hub = StreamHub(loop)
    (ib,) = _on(loop, _make(hub, 1))

    def produce():
        time.sleep(0.3)  # queued in D: keepalives go out
        ib.put(_tok(3))
        time.sleep(0.3)  # after the first token: silence, no keepalive
        ib.put(_tok(4, finish_reason="length"))
        ib.put(None)

    th = threading.Thread(target=produce)
    th.start()
    sent = [list(c.token_ids) for c in _on(loop, _collect(ib, keepalive_s=0.05, queued=lambda: True))]
    th.join()
    first = sent.index([3])
    assert first >= 2 and all(s == [] for s in sent[:first])
    assert sent[first:] == [[3], [4]]


def test_samples_of_one_request_merge_per_index_never_across(loop):
    """An ``n > 1`` request's samples share one stream (DecodeChunk.index): a lagging aio stream
    merges each sample's waiting tokens into that sample's chunk, in first-seen order."""
    hub = StreamHub(loop)
    (ib,) = _on(loop, _make(hub, 1))
    for t, i in ((1, 0), (2, 1), (3, 0), (4, 2), (5, 1)):
        c = _tok(t)
        c.index = i
        ib.put(c)
    ib.put(None)
    got = _on(loop, _collect(ib, keepalive_s=0, queued=lambda: False))
    assert [(c.index, list(c.token_ids)) for c in got] == [(0, [1, 3]), (1, [2, 5]), (2, [4])]
