"""KV events without processes: the publisher's mirror equals the radix tree after random inserts,
evictions and invalidations; a subscriber index fed the stream (resumed, lagging or restarted)
equals it too; the pair cost prefers the P and D that hold the prefix."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kvcache.page_allocator import PageAllocator
from engine.kvcache.radix_cache import RadixCache
from pd_common.kv_events import KVEventPublisher
from protos import kv_events_pb2
from router_svc.kv_index import GapError, KVEventIndex, WorkerKVIndex
from router_svc.pair_policy import KVPairPolicy, PairWeights
from router_svc.prefix_index import page_keys
from router_svc.worker import Worker

PS = 4


def tree_hashes(cache: RadixCache) -> set[int]:
    out, stack = set(), list(cache.root.children.values())
    while stack:
        n = stack.pop()
        out.update(n.hashes)
        stack.extend(n.children.values())
    return out


def put(cache: RadixCache, alloc: PageAllocator, toks: list[int]) -> None:
    """Insert the full pages of ``toks`` on fresh pages, freeing the duplicates (as a request does)."""
    n = len(toks) // PS
    if alloc.num_free < n:
        cache.evict(n - alloc.num_free)
    if alloc.num_free < n:
        return
    pages = torch.tensor(alloc.alloc(n), dtype=torch.int64)
    dup = cache.insert(toks[:n * PS], (pages[:, None] * PS + torch.arange(PS)).reshape(-1))
    if dup:
        alloc.free(pages[:dup // PS])


def churn(cache: RadixCache, alloc: PageAllocator, pub: KVEventPublisher, rng: random.Random, steps: int):
    """Random inserts (shared prefixes), locks, evictions and invalidations, published each step."""
    bases = [[rng.randrange(50) for _ in range(PS * 6)] for _ in range(4)]
    for _ in range(steps):
        op = rng.random()
        if op < 0.6:
            toks = rng.choice(bases)[:PS * rng.randrange(1, 7)] + [rng.randrange(50) for _ in range(PS * rng.randrange(0, 3))]
            put(cache, alloc, toks)
        elif op < 0.85:
            cache.evict(rng.randrange(1, 6))
        else:
            toks = rng.choice(bases)
            cache.invalidate(toks, rng.randrange(0, 6))
        pub.publish(cache.drain_events())


def test_mirror_and_index_equal_the_tree_through_churn():
    rng = random.Random(7)
    alloc = PageAllocator(40, PS)
    cache = RadixCache(PS, alloc, enable_events=True)
    pub = KVEventPublisher("w", PS, history=8)
    pub.incarnation = "inc-1"
    idx = WorkerKVIndex("w")
    stream = pub.stream(kv_events_pb2.SubscribeKVEventsRequest(), poll_s=0.0)
    idx.apply(next(stream))  # snapshot of the empty tree
    for round_ in range(30):
        churn(cache, alloc, pub, rng, rng.randrange(1, 12))
        assert pub.pages() == tree_hashes(cache)
        if round_ % 7 == 3:  # dropped stream: resume where the index stands (or snapshot if too old)
            stream = pub.stream(kv_events_pb2.SubscribeKVEventsRequest(incarnation=idx.incarnation,
                                                                       after_seq=idx.seq), poll_s=0.0)
        while idx.seq < pub.seq:
            idx.apply(next(stream))
        assert idx.pages == tree_hashes(cache), round_
    assert idx.resyncs > 0 and pub.seq > 8  # the history of 8 was outrun at least once


def test_gap_and_restart():
    pub = KVEventPublisher("w", PS)
    pub.incarnation = "a"
    alloc = PageAllocator(16, PS)
    cache = RadixCache(PS, alloc, enable_events=True)
    put(cache, alloc, list(range(8)))
    pub.publish(cache.drain_events())
    idx = WorkerKVIndex("w")
    idx.apply(next(pub.stream(kv_events_pb2.SubscribeKVEventsRequest())))
    assert idx.pages == tree_hashes(cache) and idx.seq == 1
    put(cache, alloc, list(range(12)))
    pub.publish(cache.drain_events())
    cache.evict(1)
    pub.publish(cache.drain_events())
    batches = list(pub._log)  # seq 1, 2, 3
    with pytest.raises(GapError):
        idx.apply(batches[2])  # seq 3 after 1: a gap, nothing applied
    assert idx.seq == 1
    # a restarted worker: a new incarnation answers with a snapshot; the old pages are dropped
    new = KVEventPublisher("w", PS)
    new.incarnation = "b"
    first = next(new.stream(kv_events_pb2.SubscribeKVEventsRequest(incarnation="a", after_seq=1)))
    assert first.snapshot
    idx.apply(first)
    assert idx.pages == set() and idx.incarnation == "b"


def _worker(wid: str, role: str) -> Worker:
    w = Worker(wid, role, "127.0.0.1:1", healthy=True)
    w.kv_page_bytes = 1 << 20
    return w


def test_pair_cost_pairs_the_holders():
    index = KVEventIndex()
    prompt = list(range(1, 65))  # 16 pages of 4
    keys = page_keys(prompt, PS)
    pol = KVPairPolicy(index, PS, PairWeights())
    p0, p1 = _worker("p0", "prefill"), _worker("p1", "prefill")
    d0, d1 = _worker("d0", "decode"), _worker("d1", "decode")
    index.get("p1").pages = set(keys[:12])
    index.get("d0").pages = set(keys)
    assert pol.pick([p0, p1], [d0, d1], prompt) == (p1, d0)
    c = pol.last_cost
    assert (c.prefill_tokens, c.delta_pages) == (64 - 48, 0)
    # P never counts the last token as cached: a full hit still computes one page's worth
    index.get("p1").pages = set(keys)
    assert pol.cost(p1, d0, keys, 64).prefill_tokens == PS
    # load outweighs affinity when the holder is far busier
    p1.dispatched_since_report = 10
    assert pol.pick([p0, p1], [d0, d1], prompt)[0] is p0
    with pytest.raises(ValueError, match="--kv-decode-load-weight"):
        PairWeights(decode_load=-1)


def test_router_flags_of_the_other_mode_are_refused():
    import argparse

    from router_svc import main

    p = argparse.ArgumentParser()
    main.add_arguments(p)
    assert main.pair_policy_from_args(p.parse_args([])) is None
    pol = main.pair_policy_from_args(p.parse_args(["--policy", "kv_events", "--kv-transfer-mib-weight", "3"]))
    assert pol.weights.transfer_mib == 3 and pol.weights.prefill_token == 1
    with pytest.raises(SystemExit, match="--kv-decode-load-weight needs --policy kv_events"):
        main.pair_policy_from_args(p.parse_args(["--kv-decode-load-weight", "2"]))
    with pytest.raises(SystemExit, match="--prefill-policy is for --policy per_role"):
        main.pair_policy_from_args(p.parse_args(["--policy", "kv_events", "--prefill-policy", "least_load"]))
    with pytest.raises(SystemExit, match="--kv-prefill-token-weight must be >= 0"):
        main.pair_policy_from_args(p.parse_args(["--policy", "kv_events", "--kv-prefill-token-weight", "-1"]))
