"""The router end to end on 2 prefill + 2 decode workers (real processes, registry discovery,
cache_aware for both roles): greedy equality across both pairs, shared-prefix follow-ups go to the
workers that hold the prefix, and a decode worker killed mid-run: its request waiting for the first
token is retried on the other pair, its request already streaming ends with UNAVAILABLE naming it
(this stack's router runs with ``--migration-limit 0``; migration: tests/e2e/test_router_migration.py),
and new requests keep succeeding."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos import router_pb2
from tests.e2e.conftest import MAX_TOKENS, greedy, reference_ids, stack_fixture, worker_targets
from tests.integration.conftest import assert_idle_accounting, get_load

PREFIX = ("Ships entering the harbour at night followed the lighthouse beam, which swept across the water "
          "every eight seconds. The keeper trimmed the wick, wound the clockwork and wrote the name of every "
          "vessel in his logbook, whatever the weather. ") * 2


stack = stack_fixture(prefill=2, decode=2, router_args=["--migration-limit", "0"])


def run_while_killed(stub, proc, input_ids):
    """``run(stub, input_ids)`` while ``proc`` is frozen (SIGSTOP: the router still sees it healthy until
    its health check times out) and then, 0.8 s in, killed; returns run's ``(ids, last)``."""
    os.kill(proc.popen.pid, signal.SIGSTOP)
    result = {}
    t = threading.Thread(target=lambda: result.update(out=run(stub, input_ids)))
    t.start()
    time.sleep(0.8)
    os.kill(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(10)
    t.join(120)
    return result["out"]


def run(stub, ids, max_tokens=MAX_TOKENS, **kw):
    resps = list(stub.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                                          sampling=greedy(max_tokens, **kw)), timeout=120))
    return [t for r in resps for t in r.token_ids], resps[-1]


def test_greedy_equal_on_both_pairs(stack, stub, tok):
    prompts = [tok.encode(f"Story {i}: the {w} walked along the quiet shore and") for i, w in
               enumerate(["sailor", "child", "keeper", "painter", "fisherman", "baker"])]
    refs = reference_ids(prompts, MAX_TOKENS)
    with ThreadPoolExecutor(6) as ex:
        outs = list(ex.map(lambda p: run(stub, p), prompts))
    assert [ids for ids, _ in outs] == refs
    assert {last.decode_worker for _, last in outs} == {"decode-0", "decode-1"}
    assert {last.prefill_worker for _, last in outs} == {"prefill-0", "prefill-1"}
    assert_idle_accounting(worker_targets(stack), credentials=stack.credentials.client())


def test_cache_aware_follows_shared_prefix(stack, stub, tok):
    base = tok.encode(PREFIX)
    assert len(base) >= 64
    _, first = run(stub, base + tok.encode(" Question one: what did he write?"))
    others = [run(stub, tok.encode(f"Unrelated request number {i} about cooking pasta and"))[1] for i in range(3)]
    assert {o.decode_worker for o in others} | {first.decode_worker} == {"decode-0", "decode-1"}
    for q in ("Question two: how often did the beam sweep?", "Question three: what did he wind?"):
        _, follow = run(stub, base + tok.encode(" " + q))
        assert (follow.prefill_worker, follow.decode_worker) == (first.prefill_worker, first.decode_worker)
        # the decode worker already holds the shared pages: only the delta moved, P reused its cache
        assert follow.usage.decode_prefix_tokens >= 48 and follow.usage.cached_tokens >= 48


def test_decode_worker_killed(stack, stub, tok):
    base = tok.encode(PREFIX + " Now a long story about the keeper's daughter:")
    follow_ids = base + tok.encode(" She")
    ref = reference_ids([follow_ids], MAX_TOKENS)[0]
    _, warm = run(stub, base)                        # teaches the router where the prefix lives
    victim = warm.decode_worker
    survivor = ({"decode-0", "decode-1"} - {victim}).pop()
    proc = next(p for p in stack.procs if p.name == victim)

    # (1) a request already streaming on the victim
    streaming = stub.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=base + [11]),
                                                         sampling=greedy(400, ignore_eos=True)), timeout=120)
    head = next(streaming)
    while not head.token_ids:
        head = next(streaming)
    assert head.decode_worker == victim

    # (2) a request that reaches the victim but will never get its first token from it
    # frozen: the router still sees it healthy for ~2 s (its health check has to time out first)
    ids, last = run_while_killed(stub, proc, follow_ids)
    assert ids == ref                                 # retried on the other pair, same greedy tokens
    assert last.decode_worker == survivor and last.usage.retries == 1

    with pytest.raises(grpc.RpcError) as ei:
        for _ in streaming:
            pass
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    assert victim in ei.value.details() and "after" in ei.value.details()
    assert "--migration-limit 0 reached" in ei.value.details()

    # (3) new requests keep succeeding, on the survivor
    deadline = time.monotonic() + 10
    while any(w.healthy for w in stub.ListWorkers(router_pb2.ListWorkersRequest()).workers
              if w.worker_id == victim) and time.monotonic() < deadline:
        time.sleep(0.1)
    for i in range(4):
        ids, last = run(stub, tok.encode(f"After the storm, number {i}, the sea was"))
        assert len(ids) == MAX_TOKENS and last.decode_worker == survivor
    assert_idle_accounting(worker_targets(stack), credentials=stack.credentials.client())


def test_prefill_worker_killed_before_first_token(stack, stub, tok):
    """Runs after the decode kill: 2 P + 1 D left. The prefill leg dies while D waits for its KV:
    the router cancels D's leg (Abort), re-picks the other P, and the request completes."""
    base = tok.encode("In the old harbour town the fishermen told a story every winter evening. " * 6)
    follow_ids = base + tok.encode(" The story began")
    ref = reference_ids([follow_ids], MAX_TOKENS)[0]
    _, warm = run(stub, base)
    victim = warm.prefill_worker
    survivor = ({"prefill-0", "prefill-1"} - {victim}).pop()
    proc = next(p for p in stack.procs if p.name == victim)
    ids, last = run_while_killed(stub, proc, follow_ids)
    assert ids == ref
    assert last.prefill_worker == survivor and last.usage.retries == 1
    for i in range(2):
        ids, last = run(stub, tok.encode(f"Later that evening, number {i}, the lamps"))
        assert len(ids) == MAX_TOKENS and last.prefill_worker == survivor
    # the surviving prefill is idle; the decode worker keeps the destination pages of the first attempt
    # quarantined (the frozen P might have been writing them) until its fence timeout, so on D only the
    # accounting identity and zero locks are asserted here
    assert_idle_accounting([("prefill", w["grpc"]) for w in stack.endpoints["prefill"] if w["worker_id"] == survivor],
                           credentials=stack.credentials.client())
    for role, addr in worker_targets(stack):
        if role == "decode":
            a = get_load(addr, "decode", stack.credentials.client()).accounting
            assert a.free_pages + a.evictable_pages + a.locked_pages + a.owned_pages == a.total_pages, a
            assert a.locked_pages == 0 and a.min_lock_ref == 0 and a.held_req_slots == 0, a


def test_router_counted_the_retries(stack):
    text = urllib.request.urlopen(f"http://{stack.endpoints['router']['metrics']}/metrics", timeout=10).read().decode()
    retries = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("halfmoon_router_retries_total{")}
    assert retries.get("decode", 0) + retries.get("prefill", 0) >= 2, retries
    errors = [line for line in text.splitlines() if line.startswith("halfmoon_router_requests_total{")
              and 'status="error"' in line]
    assert errors and float(errors[0].rsplit(" ", 1)[1]) >= 1   # the stream cut by the decode kill
