"""What one ``Generate`` stream sends: the scheduler's per-token chunks, coalesced when the stream lags.

The scheduler thread puts one ``DecodeChunk`` per token on a request's queue (``DecodeJob.out``).
Sending each as its own gRPC message costs the serving thread a wake-up, a serialization and a
blocking write per token per stream; under a large batch those threads fall behind the steps and
that per-message cost, paid under the GIL, slows the scheduler thread itself. So a stream sends, in
one ``DecodeChunk``, every token already waiting on its queue when it gets to write: a stream that
keeps up still sends one token per message (no added latency); one that lags catches up in one
message. ``token_ids`` and ``logprobs`` are repeated already (one logprob per token when asked), and
the summary fields of the first and the last chunk are kept, so a consumer that handles a chunk of
n tokens sees exactly what n one-token chunks would have told it. The samples of an ``n > 1``
request share the queue: chunks merge per sample (``DecodeChunk.index``), never across samples.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator

from pd_common.protocol import ServiceError
from protos import decode_pb2

# the summary D sets on a request's first chunk and on its last one (``RunningBatch.emit``)
_SUMMARY = ("prompt_tokens", "cached_tokens", "decode_prefix_tokens", "kv_pages_transferred",
            "kv_bytes_transferred", "completion_tokens")
OPEN = object()   # no end read yet
EMPTY = object()  # nothing waiting


def merge_into(acc: decode_pb2.DecodeChunk, nxt: decode_pb2.DecodeChunk) -> None:
    """Append ``nxt`` (the chunk streamed after ``acc``) to ``acc``: tokens and logprobs in order;
    its finish reason, matched stop and non-zero summary fields replace ``acc``'s."""
    acc.token_ids.extend(nxt.token_ids)
    acc.logprobs.extend(nxt.logprobs)
    if nxt.finish_reason:
        acc.finish_reason = nxt.finish_reason
        acc.matched_stop = nxt.matched_stop
    for f in _SUMMARY:
        v = getattr(nxt, f)
        if v:
            setattr(acc, f, v)


def gather(merged: dict[int, decode_pb2.DecodeChunk], take: Callable[[], object], coalesce: bool) -> object:
    """Merge every chunk already waiting (``take()``: the next item, or ``EMPTY``) into
    ``merged``'s chunk of its sample (``DecodeChunk.index``; a new sample's chunk is added), unless
    not ``coalesce``. Returns the end read behind them (None: finished, or a ServiceError) or
    ``OPEN``."""
    while coalesce:
        nxt = take()
        if nxt is EMPTY:
            break
        if not isinstance(nxt, decode_pb2.DecodeChunk):
            return nxt
        if nxt.index in merged:
            merge_into(merged[nxt.index], nxt)
        else:
            merged[nxt.index] = nxt
    return OPEN


def next_chunks(item: object, take: Callable[[], object],
                coalesce: bool) -> tuple[list[decode_pb2.DecodeChunk], object]:
    """What a stream does with the item it read: (the chunks to send: one per sample, in
    first-seen order, each with every chunk of that sample waiting behind it merged in
    (``gather``), or none; the end behind them, or ``OPEN``). Raises ``StreamEnd`` for a failure
    read first."""
    if item is None:
        return [], None
    if isinstance(item, ServiceError):
        raise StreamEnd(item)
    merged = {item.index: item}
    end = gather(merged, take, coalesce)
    return list(merged.values()), end


def over(end: object) -> bool:
    """Whether the stream ends after its chunk: True when finished (None), raises ``StreamEnd``
    for a failure, False while ``OPEN``."""
    if end is not None and end is not OPEN:
        raise StreamEnd(end)
    return end is None


def _get_nowait(out: queue.SimpleQueue) -> object:
    try:
        return out.get_nowait()
    except queue.Empty:
        return EMPTY


class StreamEnd(Exception):
    """The request failed: ``error`` is the ServiceError the stream aborts with."""

    def __init__(self, error: ServiceError):
        super().__init__(str(error))
        self.error = error


def stream_chunks(out: queue.SimpleQueue, *, keepalive_s: float, queued: Callable[[], bool],
                  coalesce: bool = True) -> Iterator[decode_pb2.DecodeChunk]:
    """The chunks one Generate stream sends, read from a job's queue until it ends.

    Args:
        out: ``DecodeJob.out`` (DecodeChunk items, then None or one ServiceError).
        keepalive_s: before the first token, an empty DecodeChunk after this many seconds without
            one (0: none); never after the first token.
        queued: whether the request still waits in D (read when a keepalive is due).
        coalesce: merge every chunk already waiting into the one sent (False: one per item).

    Yields DecodeChunks; raises ``StreamEnd`` when the request failed. Chunks read before a
    failure or the end are yielded first.
    """
    sent = False
    while True:
        try:
            item = out.get(timeout=keepalive_s if keepalive_s and not sent else None)
        except queue.Empty:
            if queued():  # still before the first token either way
                yield decode_pb2.DecodeChunk()
            continue
        chunks, end = next_chunks(item, lambda: _get_nowait(out), coalesce)
        if chunks:
            sent = True
            yield from chunks
        if over(end):
            return
