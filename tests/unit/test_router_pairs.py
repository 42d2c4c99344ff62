"""The router pairs a prefill worker only with decode workers whose KV pool matches its own (the
``KVLayout`` each published in the registry): a mismatched pair would be refused by the workers on
every request, so the router never picks one, and says which flag differs when no pair matches."""

from __future__ import annotations

import pytest

from protos import registry_pb2
from router_svc.policies import NoWorkerError, make_policy
from router_svc.pool import WorkerPool
from router_svc.worker import DECODE, PREFILL, Worker, kv_compatible, kv_signature


def layout(**kw):
    base = dict(layout="page_major", dtype="bfloat16", page_size=16, num_layers=32, kv_heads=8, head_dim=128,
                num_pages=100, page_bytes=32768, model="m")
    base.update(kw)
    return registry_pb2.KVLayout(**base)


def pool_of(prefill: dict, decode: dict) -> WorkerPool:
    pool = WorkerPool()
    for role, ws in ((PREFILL, prefill), (DECODE, decode)):
        for wid, lay in ws.items():
            pool.workers[wid] = Worker(wid, role, "127.0.0.1:1", healthy=True,
                                       kv_signature=None if lay is None else kv_signature(lay))
    return pool


def test_signature_ignores_addresses_and_sizes():
    a, b = layout(num_pages=10, buffer_addrs=[1]), layout(num_pages=999, buffer_addrs=[2])
    assert kv_signature(a) == kv_signature(b)
    assert kv_signature(layout(layout="layer_major")) != kv_signature(a)
    assert kv_signature(registry_pb2.KVLayout()) is None  # nothing published: unknown, matches anything
    assert kv_compatible(Worker("x", PREFILL, "a"), Worker("y", DECODE, "b", kv_signature=kv_signature(a)))


def test_pairs_only_matching_pools():
    pool = pool_of({"p-bf16": layout(), "p-fp16": layout(dtype="float16")},
                   {"d-fp16": layout(dtype="float16"), "d-bf16": layout()})
    rr_p, rr_d = make_policy("round_robin"), make_policy("round_robin")
    pairs = {tuple(w.worker_id for w in pool.pick_pair(rr_p, rr_d, [1, 2, 3])) for _ in range(8)}
    assert pairs == {("p-bf16", "d-bf16"), ("p-fp16", "d-fp16")}


def test_prefill_without_a_match_is_passed_over():
    pool = pool_of({"p-layer": layout(layout="layer_major"), "p-page": layout()}, {"d-page": layout()})
    for _ in range(4):
        p, d = pool.pick_pair(make_policy("round_robin"), make_policy("round_robin"), [1])
        assert (p.worker_id, d.worker_id) == ("p-page", "d-page")
    assert pool.workers["p-layer"].dispatched_since_report == 0  # not counted as sent there


def test_no_matching_pair_names_the_flags():
    pool = pool_of({"prefill-0": layout()}, {"decode-0": layout(layout="layer_major", page_size=32)})
    with pytest.raises(NoWorkerError, match=r"layout page_major vs layer_major \(--kv-layout\).*"
                                            r"page_size 16 vs 32 \(--page-size\)"):
        pool.pick_pair(make_policy("round_robin"), make_policy("round_robin"), [1])


def test_unknown_layouts_and_missing_roles():
    pool = pool_of({"a:1": None}, {"b:2": None})  # a static list: no layouts known, any pair goes
    p, d = pool.pick_pair(make_policy("least_load"), make_policy("least_load"), [1])
    assert (p.worker_id, d.worker_id) == ("a:1", "b:2")
    with pytest.raises(NoWorkerError, match="no healthy decode worker"):
        pool_of({"p": layout()}, {}).pick_pair(make_policy("round_robin"), make_policy("round_robin"), [1])
    with pytest.raises(NoWorkerError, match="no healthy prefill worker"):
        pool_of({}, {"d": layout()}).pick_pair(make_policy("round_robin"), make_policy("round_robin"), [1])
