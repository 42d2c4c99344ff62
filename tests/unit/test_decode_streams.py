"""decode_svc.streams: what one Generate stream sends from its job's queue (real queue, real protos).

A stream that lags finds several per-token chunks waiting: it sends them as one chunk that says what
they said together (tokens and logprobs in order, the first chunk's summary, the last one's finish and
summary); a failure after tokens still sends those tokens first; keepalives only before a token."""

from __future__ import annotations

import queue
import threading

import grpc
import pytest

from decode_svc.streams import StreamEnd, stream_chunks
from pd_common.protocol import ServiceError
from protos import common_pb2, decode_pb2


def _tok(t: int, **kw) -> decode_pb2.DecodeChunk:
    return decode_pb2.DecodeChunk(token_ids=[t], logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=-t / 10)], **kw)


def _lagging(*items) -> queue.SimpleQueue:
    q = queue.SimpleQueue()
    for it in items:
        q.put(it)
    return q


def _per_token_run():
    return (_tok(5, prompt_tokens=7, cached_tokens=2, decode_prefix_tokens=16, kv_pages_transferred=1,
                 kv_bytes_transferred=4096, completion_tokens=1),
            _tok(6), _tok(7),
            _tok(8, finish_reason="stop", matched_stop="xy", prompt_tokens=7, cached_tokens=2,
                 decode_prefix_tokens=16, kv_pages_transferred=1, kv_bytes_transferred=4096, completion_tokens=4))


def test_lagging_stream_sends_waiting_tokens_in_one_chunk():
    got = list(stream_chunks(_lagging(*_per_token_run(), None), keepalive_s=0, queued=lambda: True))
    assert len(got) == 1
    c = got[0]
    assert list(c.token_ids) == [5, 6, 7, 8]
    assert [(lp.token_id, round(lp.logprob, 2)) for lp in c.logprobs] == [(5, -0.5), (6, -0.6), (7, -0.7), (8, -0.8)]
    assert (c.finish_reason, c.matched_stop) == ("stop", "xy")
    assert (c.prompt_tokens, c.cached_tokens, c.decode_prefix_tokens, c.kv_pages_transferred,
            c.kv_bytes_transferred, c.completion_tokens) == (7, 2, 16, 1, 4096, 4)


def test_off_sends_one_chunk_per_token():
    got = list(stream_chunks(_lagging(*_per_token_run(), None), keepalive_s=0, queued=lambda: True,
                             coalesce=False))
    assert [list(c.token_ids) for c in got] == [[5], [6], [7], [8]]
    assert got[0].completion_tokens == 1 and got[-1].finish_reason == "stop"


def test_failure_after_tokens_sends_them_then_ends_with_the_error():
    err = ServiceError(grpc.StatusCode.CANCELLED, "aborted: client gone")
    it = stream_chunks(_lagging(_tok(1), _tok(2), err), keepalive_s=0, queued=lambda: True)
    assert list(next(it).token_ids) == [1, 2]
    with pytest.raises(StreamEnd) as e:
        next(it)
    assert e.value.error is err


def test_keepalives_only_before_the_first_token():
    q = queue.SimpleQueue()
    sent = []

    def produce():
        threading.Event().wait(0.3)  # queued in D for a while: keepalives go out
        q.put(_tok(3))
        threading.Event().wait(0.3)  # after the first token: silence, no keepalive
        q.put(_tok(4, finish_reason="length"))
        q.put(None)

    th = threading.Thread(target=produce)
    th.start()
    for c in stream_chunks(q, keepalive_s=0.05, queued=lambda: True):
        sent.append(list(c.token_ids))
    th.join()
    first = sent.index([3])
    assert first >= 2 and all(s == [] for s in sent[:first])
    assert sent[first:] == [[3], [4]]
