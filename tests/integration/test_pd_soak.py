"""Soak: many greedy requests through the router while workers stall, with cancels and cache churn.

Registry + 2 prefill workers + 1 decode worker (``--kv-checksums``, a pool of a few requests' worth
of pages, so pages are reused and the radix cache evicts all the time) + the router, all with short
leases, a short write window and fence margin (docs/architecture.md, Fencing one-sided writes).
A fixed-seed workload: 30 % of the requests extend one of a few shared system-prompt stems, the rest
draw from a pool of short prompts (repeats are full radix hits on D, whose cached pages are then
re-verified); 10 % are cancelled by the client at a random point; P and D are each SIGSTOPped and
resumed a few times, some stops longer than the lease.

Every token any request received, completed or not, must be a prefix of the co-located engine's
greedy output for its prompt (a request that does not complete ends with a gRPC status, never with
wrong tokens). At the end: no checksum mismatch on D, exact KV accounting with nothing held on
every worker, and the figures printed (completed / cancelled / failed by code / retractions /
quarantine releases by cause).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos import common_pb2, router_pb2, router_pb2_grpc
from tests.integration.conftest import (assert_clean_log, assert_idle_accounting, model_available,
                                        start_registry, start_router, start_worker, wait_ready,
                                        wait_router_sees)
from tests.integration.pd_driver import colocated_generate

pytestmark = pytest.mark.skipif(not model_available(), reason="model not pulled (halfmoon models pull)")

SEED = 20240601
MAX_TOKENS = (4, 12)
CONCURRENCY = 8
TTL = 3                       # registry lease of every worker
LONG_STOP = 2 * TTL + 2.5     # past the lease: the registry drops the record, D's liveness checks see it gone
SHORT_STOP = 1.0
D_PAGES = 40                  # ~8 requests' prompt + reserve: the radix cache evicts constantly
REQUEST_TIMEOUT = 120.0       # client deadline; generous for a shared 2-core machine
BACKOFF = 1.0                 # a client waits after UNAVAILABLE (no healthy pair while a worker is stopped)

WORDS = ("the lighthouse keeper climbed stairs every evening ships passed rocky point beam swept "
         "across water winter storms wind logbook vessels harbour fog bell island gulls tide rope "
         "lantern captain sailed north morning bread village market children river bridge stone").split()
STEMS = ("You are a helpful assistant. Answer briefly and politely, and never invent facts. ",
         "System: you translate English into French. Keep the meaning and the tone of the text. ",
         "The following is a conversation between a curious student and a patient teacher. ")


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def _workload(n: int, rng: random.Random) -> list[dict]:
    """n requests: prompt (token ids), max_tokens, cancel point (None, ("after", s) or ("chunks", k))."""
    from transformers import AutoTokenizer

    from engine.model_store import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m-instruct")))
    pool = [tok.encode(_sentence(rng, rng.randint(4, 24))) for _ in range(max(40, n * 35 // 100))]
    stems = [tok.encode(s) for s in STEMS]
    suffixes = [[tok.encode(_sentence(rng, rng.randint(2, 10))) for _ in range(max(8, n // 30))]
                for _ in stems]
    reqs = []
    for _ in range(n):
        if rng.random() < 0.3:
            s = rng.randrange(len(stems))
            prompt = stems[s] + rng.choice(suffixes[s])
        else:
            prompt = rng.choice(pool)
        cancel = None
        if rng.random() < 0.1:
            cancel = ("after", rng.uniform(0.0, 1.5)) if rng.random() < 0.5 else ("chunks", rng.randint(1, 3))
        reqs.append({"prompt": prompt, "max_tokens": rng.randint(*MAX_TOKENS), "cancel": cancel})
    return reqs


def _scrape(address: str) -> str:
    return urllib.request.urlopen(f"http://{address}/metrics", timeout=30).read().decode()


def _series(text: str, name: str) -> dict[str, float]:
    """{label values joined by ',' (or '' without labels): value} of counter ``name``."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, value = line.rsplit(" ", 1)
            labels = head[len(name):].strip("{}")
            out[",".join(v.split("=", 1)[1].strip('"') for v in labels.split(",") if v)] = float(value)
    return out


class Client:
    """One Router.Generate stream per request; cancels on the request's cancel point."""

    def __init__(self, address: str, references: dict):
        self.chan = grpc.insecure_channel(address)
        self.stub = router_pb2_grpc.RouterStub(self.chan)
        self.references = references
        self.lock = threading.Lock()
        self.outcomes = Counter()
        self.wrong = []
        self.started = 0

    def run(self, req: dict) -> None:
        with self.lock:
            self.started += 1
        params = common_pb2.SamplingParams(max_tokens=req["max_tokens"], temperature=0.0)
        stream = self.stub.Generate(router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=req["prompt"]), sampling=params), timeout=REQUEST_TIMEOUT)
        cancel, timer = req["cancel"], None
        if cancel and cancel[0] == "after":
            timer = threading.Timer(cancel[1], stream.cancel)
            timer.start()
        tokens, finish, code = [], "", None
        try:
            for chunk in stream:
                tokens.extend(chunk.token_ids)
                finish = chunk.finish_reason or finish
                if cancel and cancel[0] == "chunks" and len(tokens) >= cancel[1] and not finish:
                    stream.cancel()
        except grpc.RpcError as e:
            code = e.code().name
        finally:
            if timer:
                timer.cancel()
        ref = self.references[tuple(req["prompt"])][:req["max_tokens"]]
        complete = code is None and finish in ("stop", "length")
        bad = tokens != ref if complete else tokens != ref[:len(tokens)]
        with self.lock:
            if bad or (code is None and not complete):
                self.wrong.append((req, tokens, ref, finish, code))
            self.outcomes["completed" if complete else "cancelled" if code == "CANCELLED" and cancel
                          else f"failed {code}"] += 1
        if code == "UNAVAILABLE":
            time.sleep(BACKOFF)


def _stopper(procs: dict, client: Client, n: int, stops: list, log: list, done: threading.Event) -> None:
    """SIGSTOP / SIGCONT ``procs[name]`` for ``seconds`` once ``fraction`` of the requests started."""
    for fraction, name, seconds in stops:
        while client.started < fraction * n and not done.is_set():
            time.sleep(0.05)
        if done.is_set():
            return
        proc = procs[name]
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        log.append((client.started, name, seconds))


def _soak(tmp_path, n: int, stops: list) -> None:
    rng = random.Random(SEED)
    reqs = _workload(n, rng)
    distinct = sorted({tuple(r["prompt"]) for r in reqs})
    t0 = time.monotonic()
    refs = dict(zip(distinct, colocated_generate([list(p) for p in distinct], MAX_TOKENS[1])))
    t_ref = time.monotonic() - t0

    reg = start_registry(tmp_path, ttl=TTL)
    lease = ["--lease-ttl", str(TTL), "--lease-fence-margin", "0.5", "--kv-checksums"]
    procs = {"registry": reg}
    try:
        for i in range(2):
            procs[f"prefill-{i}"] = start_worker("prefill", reg.address, tmp_path, f"prefill-{i}",
                                                 wait=False, num_pages=256,
                                                 extra=[*lease, "--destination-timeout", "30"])
        procs["decode"] = start_worker("decode", reg.address, tmp_path, "decode-0", num_pages=D_PAGES,
                                       wait=False, extra=[*lease, "--kv-write-window", "4",
                                                          "--fence-margin", "2", "--kv-wait-timeout", "30"])
        for name in ("prefill-0", "prefill-1", "decode"):
            wait_ready(procs[name])
        router = procs["router"] = start_router(tmp_path, registry=reg.address,
                                                extra=["--first-token-timeout", "40"])
        wait_router_sees(router, 3)

        client = Client(router.address, refs)
        stop_log, done = [], threading.Event()
        stopper = threading.Thread(target=_stopper, args=(procs, client, n, stops, stop_log, done),
                                   daemon=True)
        t1 = time.monotonic()
        stopper.start()
        try:
            with ThreadPoolExecutor(CONCURRENCY) as ex:
                list(ex.map(client.run, reqs))
        finally:
            done.set()
            stopper.join(60)
        t_run = time.monotonic() - t1

        workers = [("prefill", procs["prefill-0"].address), ("prefill", procs["prefill-1"].address),
                   ("decode", procs["decode"].address)]
        # quarantined pages of a stalled P come back at its notice or, at the latest, the fence deadline
        acct = assert_idle_accounting(workers, timeout=90)
        d_metrics = _scrape(procs["decode"].metrics_address)
        mismatches = sum(_series(d_metrics, "halfmoon_decode_kv_checksum_mismatches_total").values())
        releases = _series(d_metrics, "halfmoon_decode_quarantine_releases_total")
        retractions = _series(d_metrics, "halfmoon_decode_retractions_total")
        completed = client.outcomes["completed"]
        print(f"\nsoak: {n} requests ({len(distinct)} distinct prompts, seed {SEED}), concurrency "
              f"{CONCURRENCY}, references {t_ref:.0f} s, run {t_run:.0f} s")
        print(f"  outcomes: {dict(sorted(client.outcomes.items()))}")
        print(f"  wrong outputs: {len(client.wrong)}; checksum mismatches: {mismatches:g}")
        print(f"  stops (requests started, worker, seconds): {stop_log}")
        print(f"  retractions: { {k: v for k, v in retractions.items() if v} }")
        print(f"  quarantine releases: { {k: v for k, v in releases.items() if v} }")
        print(f"  decode pool at the end: free {acct['decode'].free_pages} evictable "
              f"{acct['decode'].evictable_pages} of {acct['decode'].total_pages}")
        assert not client.wrong, client.wrong[:5]
        assert sum(client.outcomes.values()) == n
        assert len(stop_log) == len(stops), stop_log
        assert mismatches == 0, d_metrics
        # a soak where nearly everything failed proves nothing
        assert completed >= 0.6 * n, client.outcomes
        # a worker leaving the pool mid-request must fail over or end with a status, never crash a handler
        assert_clean_log(router)
    finally:
        for name in ("router", "decode", "prefill-1", "prefill-0", "registry"):
            if name in procs:
                procs[name].stop()


def test_pd_soak_short(tmp_path):
    _soak(tmp_path, 80, [(0.3, "prefill-0", LONG_STOP), (0.6, "decode", LONG_STOP)])


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ~15 min on 2 shared cores; the suite's 600 s per test is too short
def test_pd_soak(tmp_path):
    _soak(tmp_path, 1000, [(0.10, "prefill-0", SHORT_STOP), (0.20, "decode", SHORT_STOP),
                           (0.32, "prefill-1", LONG_STOP), (0.45, "decode", LONG_STOP),
                           (0.58, "prefill-0", LONG_STOP), (0.70, "decode", 2 * SHORT_STOP),
                           (0.82, "prefill-1", SHORT_STOP), (0.90, "decode", LONG_STOP)])
