"""Decode service: pre-allocates KV for the delta, receives it from a prefill worker, decodes.

``scheduler`` (one thread: pre-allocation with D's radix cache, KV wait, commit, continuous decode
batch, quarantine of pages P may still write), ``prebuilt`` (the first batch's ``out_cache_loc``),
``peers`` (SetDestination / Abort / liveness toward prefill workers, off the scheduler thread),
``server`` (gRPC halfmoon.v1.Decode), ``main`` (``halfmoon serve-decode``).
"""
