"""Decode service: pre-allocates KV for the delta, receives it from a prefill worker, decodes.

``scheduler`` (the one thread owning D's KV: composes ``prealloc`` (FIFO pre-allocation with D's
radix cache), ``kv_wait`` (P's notice, commit, KV-wait timeouts, liveness), ``running`` and
``overlap`` (the continuous decode batch) and ``quarantine`` (pages P may still write)), ``jobs``
(a request and its states), ``messages`` (what the scheduler says to P and hears back), ``prebuilt``
(the first batch's ``out_cache_loc``), ``peers`` (SetDestination / Abort / liveness toward prefill
workers, off the scheduler thread), ``server`` (gRPC halfmoon.v1.Decode, a thread per stream) and
``aio_server`` (the same with Generate on grpc.aio, the default), ``streams`` (what one Generate
stream sends: per-token chunks, coalesced when it lags), ``stream_hub`` (their hand-over to the aio
streams, once per burst), ``step_clock`` (device vs host
time per step), ``main`` (``halfmoon serve-decode``).
"""

from decode_svc.streams import StreamEnd, stream_chunks

__all__ = ["StreamEnd", "stream_chunks"]
