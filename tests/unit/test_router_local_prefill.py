"""Conditional disaggregation's decision (router_svc/local_prefill.py): D alone when its uncached tail
of the prompt is short (a follow-up turn, or a short prompt no D holds anything of: Dynamo's
``max_local_prefill_length``), or when it holds part of the prompt while every P is busy; the router's
flags refuse a threshold without ``--policy kv_events``."""

from __future__ import annotations

import argparse

import pytest

from protos import common_pb2
from router_svc import main as router_main
from router_svc.kv_index import KVEventIndex
from router_svc.local_prefill import LocalPrefillPolicy
from router_svc.prefix_index import page_keys
from router_svc.worker import DECODE, PREFILL, Worker
from telemetry import metrics as M

PS = 16
PROMPT = list(range(1, 161))  # 10 pages


def workers(role: str, *ids: str, waiting: int = 0) -> list[Worker]:
    out = []
    for wid in ids:
        w = Worker(wid, role, "127.0.0.1:1", healthy=True)
        w.load = common_pb2.LoadReport(waiting_requests=waiting)
        out.append(w)
    return out


def holding(**pages: int) -> KVEventIndex:
    """An index where worker ``id`` holds the first ``pages[id]`` pages of PROMPT."""
    index = KVEventIndex()
    for wid, n in pages.items():
        index.get(wid).pages = set(page_keys(PROMPT, PS)[:n])
    return index


def test_short_tail_goes_to_the_decode_worker_holding_most():
    policy = LocalPrefillPolicy(holding(d0=4, d1=9), PS, max_tail_tokens=32)
    before = M.ROUTER_LOCAL_PREFILLS.labels(reason="short_tail")._value.get()
    choice = policy.choose(workers(PREFILL, "p0"), workers(DECODE, "d0", "d1"), PROMPT)
    assert choice is not None and choice.decode.worker_id == "d1" and choice.reason == "short_tail"
    assert choice.tail_tokens == 160 - 9 * PS
    assert choice.decode.dispatched_since_report == 1
    assert M.ROUTER_LOCAL_PREFILLS.labels(reason="short_tail")._value.get() == before + 1


def test_full_hit_still_computes_the_last_page():
    # D holds all 10 pages; it must compute the last token's logits: at most len - 1 tokens are a hit
    choice = LocalPrefillPolicy(holding(d0=10), PS, max_tail_tokens=16).choose(
        workers(PREFILL, "p0"), workers(DECODE, "d0"), PROMPT)
    assert choice is not None and choice.tail_tokens == PS


def test_long_tail_goes_to_prefill():
    ds = workers(DECODE, "d0", "d1")
    assert LocalPrefillPolicy(holding(d0=4), PS, max_tail_tokens=32).choose(workers(PREFILL, "p0"), ds, PROMPT) is None
    # nothing held and the whole prompt over the threshold: PD, even when every P is busy (a D
    # holding nothing would compute a prompt of any length inside its decode loop)
    policy = LocalPrefillPolicy(holding(), PS, max_tail_tokens=128, prefill_queue=1)
    assert policy.choose(workers(PREFILL, "p0", waiting=5), ds, PROMPT) is None
    assert all(d.dispatched_since_report == 0 for d in ds)


def test_short_fresh_prompt_goes_to_the_least_loaded_decode_worker():
    # no D holds anything of it, but the whole prompt (160 tokens) is under the threshold: D computes
    # it (no P hop, no destination round trip, no KV transfer), as Dynamo's max_local_prefill_length
    ds = workers(DECODE, "d0", waiting=2) + workers(DECODE, "d1")
    before = M.ROUTER_LOCAL_PREFILLS.labels(reason="short_tail")._value.get()
    choice = LocalPrefillPolicy(holding(), PS, max_tail_tokens=160).choose(workers(PREFILL, "p0"), ds, PROMPT)
    assert choice is not None and choice.decode.worker_id == "d1" and choice.reason == "short_tail"
    assert choice.tail_tokens == len(PROMPT)
    assert [d.dispatched_since_report for d in ds] == [0, 1]
    assert M.ROUTER_LOCAL_PREFILLS.labels(reason="short_tail")._value.get() == before + 1


def test_a_decode_worker_holding_pages_beats_a_less_loaded_one_holding_none():
    ds = workers(DECODE, "d0", waiting=3) + workers(DECODE, "d1")
    choice = LocalPrefillPolicy(holding(d0=2), PS, max_tail_tokens=256).choose(workers(PREFILL, "p0"), ds, PROMPT)
    assert choice is not None and choice.decode.worker_id == "d0" and choice.tail_tokens == 160 - 2 * PS


def test_busy_prefill_workers_send_a_partial_hit_to_decode():
    policy = LocalPrefillPolicy(holding(d0=2), PS, max_tail_tokens=16, prefill_queue=3)
    ds = workers(DECODE, "d0")
    assert policy.choose(workers(PREFILL, "p0", "p1", waiting=2), ds, PROMPT) is None
    busy = workers(PREFILL, "p0", waiting=3) + workers(PREFILL, "p1", waiting=4)
    choice = policy.choose(busy, ds, PROMPT)
    assert choice is not None and choice.reason == "prefill_queue" and choice.tail_tokens == 160 - 2 * PS


def test_excluded_or_unhealthy_decode_workers_are_never_chosen():
    ds = workers(DECODE, "d0", "d1")
    ds[1].healthy = False
    policy = LocalPrefillPolicy(holding(d0=9, d1=9), PS, max_tail_tokens=64)
    assert policy.choose(workers(PREFILL, "p0"), ds, PROMPT, exclude={"d0"}) is None


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    router_main.add_arguments(p)
    return p.parse_args(list(argv))


def test_flags_need_kv_events_and_sane_values():
    with pytest.raises(SystemExit, match="--local-prefill-max-tokens needs --policy kv_events"):
        router_main.local_prefill_from_args(_args("--local-prefill-max-tokens", "64"), None)
    args = _args("--policy", "kv_events", "--local-prefill-queue", "-1")
    with pytest.raises(SystemExit, match="must be >= 0"):
        router_main.local_prefill_from_args(args, router_main.pair_policy_from_args(args))
    args = _args("--policy", "kv_events", "--local-prefill-max-tokens", "256")
    policy = router_main.local_prefill_from_args(args, router_main.pair_policy_from_args(args))
    assert policy is not None and policy.max_tail_tokens == 256 and policy.prefill_queue == 0
    assert router_main.local_prefill_from_args(_args("--policy", "kv_events"), None) is None
