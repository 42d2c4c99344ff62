"""KV events end to end on 2 prefill + 2 decode workers (real processes, registry discovery, router
``--policy kv_events``): the router's per-worker index (``router_svc.kv_subscriber`` run here against
the same workers) equals every worker's radix tree after inserts, evictions, dropped streams and a
worker restart, and the joint policy sends a follow-up turn to the P and D that hold its prefix."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import grpc
import pytest

from halfmoon.launcher import Stack
from protos import kv_events_pb2, kv_events_pb2_grpc, router_pb2
from router_svc.kv_index import KVEventIndex
from router_svc.kv_subscriber import KVSubscriber
from router_svc.prefix_index import page_keys
from router_svc.worker import Worker
from tests.e2e.conftest import greedy, router_stub, running_stack, worker_targets
from tests.integration.conftest import assert_idle_accounting, get_load

PS = 16
P_PAGES, D_PAGES = 48, 128  # P's pool holds two of the churn prompts: it must evict


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("e2e-kv-events"), prefill=2, decode=2, policy="kv_events",
                       role_args={"prefill": ["--num-pages", str(P_PAGES)],
                                  "decode": ["--num-pages", str(D_PAGES)]}) as st:
        yield st


@pytest.fixture(scope="module")
def stub(stack):
    ch, s = router_stub(stack)
    yield s
    ch.close()


class Watcher:
    """The router's subscriber code on its own event loop thread, following every worker."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.index = KVEventIndex()
        self.loop = asyncio.new_event_loop()
        self.subs: dict[str, KVSubscriber] = {}
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.call(self._start)

    def call(self, fn, *args):
        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def _start(self) -> None:
        for role in ("prefill", "decode"):
            for w in self.stack.endpoints[role]:
                worker = Worker(w["worker_id"], role, w["grpc"], healthy=True)
                worker.connect(self.stack.credentials.client())
                self.subs[w["worker_id"]] = sub = KVSubscriber(worker, self.index, retry_s=0.1)
                sub.start()

    def pages(self, wid: str) -> set[int]:
        return self.call(lambda: set(self.index.get(wid).pages))

    def close(self) -> None:
        for s in self.subs.values():
            self.call(s.stop)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def watcher(stack):
    w = Watcher(stack)
    yield w
    w.close()


def snapshot(stack: Stack, address: str) -> kv_events_pb2.KVEventBatch:
    """A fresh subscription's first batch: the worker's tree as it publishes it now."""
    with stack.credentials.client().channel(address) as ch:
        call = kv_events_pb2_grpc.KVEventsStub(ch).Subscribe(kv_events_pb2.SubscribeKVEventsRequest(), timeout=10)
        first = next(call)
        call.cancel()
        return first


def assert_index_equals_trees(stack: Stack, watcher: Watcher, timeout: float = 20.0) -> None:
    """Once idle, every worker's index equals its tree: the same pages as a fresh snapshot, as many
    as the tree holds (GetLoad's evictable + locked), and the same incarnation."""
    assert_idle_accounting(worker_targets(stack), credentials=stack.credentials.client())
    for service, addr in worker_targets(stack):
        wid = next(w["worker_id"] for w in stack.endpoints[service] if w["grpc"] == addr)
        deadline = time.monotonic() + timeout
        while True:
            snap = snapshot(stack, addr)
            acc = get_load(addr, service, stack.credentials.client()).accounting
            idx = watcher.call(lambda: watcher.index.get(wid))
            mine = watcher.pages(wid)
            truth = {h for run in snap.runs for h in run.page_hashes}
            if (mine == truth and len(truth) == acc.evictable_pages + acc.locked_pages
                    and idx.incarnation == snap.incarnation) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert idx.incarnation == snap.incarnation, wid
        assert len(truth) == acc.evictable_pages + acc.locked_pages, (wid, acc)
        assert mine == truth, (wid, len(mine), len(truth))


def run(stub, ids, max_tokens=8):
    resps = list(stub.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                                          sampling=greedy(max_tokens)), timeout=120))
    return [t for r in resps for t in r.token_ids], resps[-1]


def prompt(tok, i: int, n_words: int = 60) -> list[int]:
    words = ["harbour", "lantern", "keeper", "vessel", "tide", "wick", "storm", "logbook", "beam", "night"]
    text = f"Conversation {i}: " + " ".join(words[(i * 7 + k * 3) % len(words)] + str(k % (i + 3))
                                           for k in range(n_words))
    return tok.encode(text)


def wait_holds(watcher: Watcher, wid: str, keys: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not set(keys) <= watcher.pages(wid):
        assert time.monotonic() < deadline, f"{wid} never reported the prompt's pages"
        time.sleep(0.05)


def test_follow_up_turn_goes_to_the_pair_that_holds_it(stack, stub, watcher, tok):
    convs = [prompt(tok, i) for i in (1, 2)]
    first = []
    for ids in convs:
        out, last = run(stub, ids)
        first.append((ids + out, last.prefill_worker, last.decode_worker))
    # the pairs differ (the second pick saw the first one's load), and each follow-up returns to its own
    assert {f[1] for f in first} == {"prefill-0", "prefill-1"}, first
    for full, pw, dw in first:
        wait_holds(watcher, pw, page_keys(full[:len(full) - 8], PS))
        wait_holds(watcher, dw, page_keys(full[:len(full) - 8], PS))
        follow = full + tok.encode(" And then the keeper wrote one more line.")
        _, last = run(stub, follow)
        assert (last.prefill_worker, last.decode_worker) == (pw, dw)
        assert last.usage.cached_tokens >= (len(full) - 8) // PS * PS - PS  # P's own hit
        assert last.usage.decode_prefix_tokens >= (len(full) - 8) // PS * PS - PS  # D's hit: a small delta
    assert_index_equals_trees(stack, watcher)


def test_index_equals_trees_after_evictions_and_dropped_streams(stack, stub, watcher, tok):
    before = {wid: watcher.call(lambda w=wid: watcher.index.get(w).removed_total) for wid in watcher.subs}
    for i in range(3, 9):  # 6 prompts of ~20 pages into pools of 48: the P trees must evict
        run(stub, prompt(tok, i, n_words=100))
        if i == 5:  # streams dropped while the workers keep publishing: resumed from seq or resnapshot
            for sub in watcher.subs.values():
                watcher.call(sub.resubscribe)
    assert_index_equals_trees(stack, watcher)
    removed = {wid: watcher.call(lambda w=wid: watcher.index.get(w).removed_total) - before[wid]
               for wid in watcher.subs}
    assert removed["prefill-0"] + removed["prefill-1"] > 0, removed


def test_worker_restart_drops_its_index(stack, stub, watcher, tok):
    proc = next(p for p in stack.procs if p.name == "prefill-1")
    for i in (13, 14):  # the second of two new prompts goes to the P caching less
        run(stub, prompt(tok, i))
    deadline = time.monotonic() + 10
    while not watcher.pages("prefill-1"):
        assert time.monotonic() < deadline, "prefill-1 holds nothing"
        time.sleep(0.05)
    old = watcher.call(lambda: watcher.index.get("prefill-1").incarnation)
    proc.signal(signal.SIGKILL)
    proc.popen.wait(10)
    proc.match = None
    addr = next(w["grpc"] for w in stack.endpoints["prefill"] if w["worker_id"] == "prefill-1")
    argv = list(proc.argv)
    argv[argv.index("--port") + 1] = addr.rsplit(":", 1)[1]  # the same address, a new process
    proc.argv = argv
    proc.start()
    deadline = time.monotonic() + 240
    while not proc.poll_ready():
        assert proc.alive() and time.monotonic() < deadline, proc.tail()
        time.sleep(0.2)
    deadline = time.monotonic() + 30
    while watcher.call(lambda: watcher.index.get("prefill-1").incarnation) == old:
        assert time.monotonic() < deadline, "the index never saw prefill-1's new incarnation"
        time.sleep(0.1)
    assert watcher.pages("prefill-1") == set()  # a new process: nothing cached, old pages dropped
    for i in (10, 11, 12):  # the router keeps serving and the new P's pages arrive
        out, last = run(stub, prompt(tok, i))
        assert out and last.finish_reason
    assert_index_equals_trees(stack, watcher)
