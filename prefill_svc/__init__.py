"""Prefill service: computes prompts and writes their KV into decode workers' pages.

``scheduler`` (the thread driving the ModelRunner, composing the parts below), ``jobs`` (a request's
state and D's destination for it), ``admission`` (waiting queue -> KV leases with P's prefix cache),
``chunked_prefill`` (extend batches, first-token sampling), ``kv_sender`` (delta sends, completion
notices, the transfer log), ``destinations`` (D's KVDestination buffered by room with a TTL, and its
checks), ``kv_runs`` (page runs -> transfer descriptors), ``server`` (gRPC halfmoon.v1.Prefill),
``main`` (``halfmoon serve-prefill``). ``pd_common`` holds what decode_svc shares: the PD protocol's
validation, conversions and page checksums, the scheduler loop and inbox, and the worker start-up.
"""
