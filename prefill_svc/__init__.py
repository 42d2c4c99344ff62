"""Prefill service: computes prompts and writes their KV into decode workers' pages.

``scheduler`` (one thread driving the ModelRunner: admission with P's radix cache, chunked prefill,
delta sends, completion notices, release), ``server`` (gRPC halfmoon.v1.Prefill), ``destinations``
(D's KVDestination buffered by room with a TTL), ``kv_runs`` (page runs -> transfer descriptors),
``main`` (``halfmoon serve-prefill``). ``protocol`` and ``runtime`` are shared with decode_svc: the
PD protocol's validation, conversions and page checksums, and the worker start-up both roles use.
"""
