"""Routing policies: every policy skips unhealthy/removed workers; cache_aware follows page-aligned
prefixes and falls back to the least loaded when load is imbalanced."""

import pytest

from protos import common_pb2
from router_svc.policies import POLICY_NAMES, CacheAware, NoWorkerError, make_policy
from router_svc.prefix_index import PrefixIndex, page_keys
from router_svc.worker import DECODE, Worker


def workers(n, healthy=True):
    return [Worker(worker_id=f"w{i}", role=DECODE, address=f"127.0.0.1:{1000 + i}", healthy=healthy) for i in range(n)]


def set_load(w, running):
    w.set_load(common_pb2.LoadReport(worker_id=w.worker_id, running_requests=running))


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_never_picks_unhealthy_or_removed(name):
    ws = workers(4)
    ws[0].healthy = False
    ws[2].removed = True
    pol = make_policy(name, page_size=4, seed=1)
    picked = {pol.pick(ws, list(range(i, i + 9))).worker_id for i in range(40)}
    assert picked <= {"w1", "w3"}
    assert picked  # something was picked


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_no_available_worker_raises(name):
    ws = workers(3, healthy=False)
    with pytest.raises(NoWorkerError):
        make_policy(name).pick(ws, [1, 2, 3])
    with pytest.raises(NoWorkerError):
        make_policy(name).pick([], [1, 2, 3])


def test_round_robin_cycles():
    ws = workers(3)
    pol = make_policy("round_robin")
    assert [pol.pick(ws, [1]).worker_id for _ in range(6)] == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_least_load_uses_getload_and_dispatches_since():
    ws = workers(3)
    for w, r in zip(ws, (5, 1, 3)):
        set_load(w, r)
    pol = make_policy("least_load")
    assert pol.pick(ws, [1]).worker_id == "w1"   # load 1 -> 2 (optimistic)
    assert pol.pick(ws, [1]).worker_id == "w1"   # 2 -> 3; tie with w2 next
    assert {pol.pick(ws, [1]).worker_id for _ in range(2)} == {"w1", "w2"}
    set_load(ws[0], 0)                           # a fresh report resets the optimistic count
    assert pol.pick(ws, [1]).worker_id == "w0"


def test_power_of_two_prefers_less_loaded():
    ws = workers(2)
    set_load(ws[0], 50)
    set_load(ws[1], 0)
    pol = make_policy("power_of_two", seed=0)
    # with 2 workers both are always sampled: the less loaded wins until loads cross
    assert [pol.pick(ws, [1]).worker_id for _ in range(10)] == ["w1"] * 10


def test_page_keys_are_chained_and_page_aligned():
    a = page_keys(list(range(40)), 16)
    b = page_keys(list(range(32)) + [7] * 8, 16)
    c = page_keys([99] + list(range(1, 40)), 16)
    assert len(a) == 2 and a == b           # the partial third page has no key
    assert c[0] != a[0] and c[1] != a[1]    # page 1's key depends on page 0 (chained)


def test_prefix_index_matches_whole_pages_and_evicts_lru():
    idx = PrefixIndex(page_size=4, max_pages=3)
    idx.insert(page_keys(list(range(12)), 4))
    assert idx.match(page_keys(list(range(10)), 4)) == 8
    assert idx.match(page_keys(list(range(8)) + [0, 0, 0, 0], 4)) == 8
    assert idx.match(page_keys([5] + list(range(1, 12)), 4)) == 0
    idx.insert(page_keys([9, 9, 9, 9], 4))  # 4 keys > 3: the oldest (page 0 of the first) goes
    assert len(idx) == 3
    assert idx.match(page_keys(list(range(12)), 4)) == 0


def test_cache_aware_follows_shared_prefix():
    ws = workers(3)
    pol = CacheAware(page_size=4)
    shared = list(range(100, 132))
    first = pol.pick(ws, shared + [1, 2, 3])
    others = {pol.pick(ws, [7000 + i] * 20).worker_id for i in range(5)}  # unrelated prompts spread out
    assert len(others) > 1
    for i in range(5):
        assert pol.pick(ws, shared + [50 + i] * 8).worker_id == first.worker_id


def test_cache_aware_short_match_goes_to_least_loaded():
    ws = workers(2)
    pol = CacheAware(page_size=4, cache_threshold=0.5)
    pol.index("w0").insert(page_keys(list(range(4)), 4))
    set_load(ws[0], 0)
    set_load(ws[1], 0)
    # 4 of 40 tokens match w0 (10% < 50%): no affinity, w1 has the smaller tree
    assert pol.pick(ws, list(range(40))).worker_id == "w1"


def test_cache_aware_falls_back_to_least_load_when_imbalanced():
    ws = workers(2)
    pol = CacheAware(page_size=4, balance_abs=8, balance_rel=1.5)
    prompt = list(range(64))
    pol.index("w0").insert(page_keys(prompt, 4))
    set_load(ws[0], 20)
    set_load(ws[1], 2)
    assert pol.pick(ws, prompt).worker_id == "w1"        # imbalanced: 20 - 2 > 8 and 20 > 3
    pol = CacheAware(page_size=4, balance_abs=8, balance_rel=1.5)
    pol.index("w0").insert(page_keys(prompt, 4))
    set_load(ws[0], 4)
    set_load(ws[1], 2)
    assert pol.pick(ws, prompt).worker_id == "w0"        # balanced: the prefix wins


def test_cache_aware_forgets_removed_worker():
    ws = workers(2)
    pol = CacheAware(page_size=4)
    prompt = list(range(32))
    chosen = pol.pick(ws, prompt)
    pol.forget(chosen.worker_id)
    assert len(pol.index(chosen.worker_id)) == 0


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")
