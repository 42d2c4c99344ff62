"""Fencing one-sided writes (docs/architecture.md): a stopped prefill worker whose lease expires
must not get to write a cancelled request's KV into pages D has handed to another request.

Registry + P0 (the victim, its puts delayed by the HALFMOON_TEST_PUT_DELAY_S test hook) + P1 + D,
with D's pool sized to exactly one request, so that request B can only get request A's pages. A
goes to P0, P0 is SIGSTOPped before (or in the middle of) its write, A is cancelled, B is sent
through P1 and P0 stays stopped for longer than its registry lease. After SIGCONT, B's output and
B's prompt sent again (a full hit on D's radix cache: exactly the pages A's write would hit) must
equal the co-located engine, and nothing may leak.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest

from tests.integration.conftest import (assert_idle_accounting, get_load, model_available, start_registry,
                                        start_worker, wait_ready)
from tests.integration.pd_driver import PDDriver, colocated_generate, sampling

PS = 16
LEN = 160            # 10 full pages
MAX_TOKENS = 8       # D reserves LEN + MAX_TOKENS - 1 slots: 11 pages
D_PAGES = 11         # one request fills D's pool
TTL = 2              # registry lease of every worker
WINDOW, MARGIN = 2.0, 1.0
PUT_DELAY = 1.0
PROMPT_A = [100 + (37 * i) % 4000 for i in range(LEN)]
PROMPT_B = [200 + (53 * i) % 4000 for i in range(LEN)]

pytestmark = pytest.mark.skipif(not model_available(), reason="model not pulled")


@pytest.fixture(scope="module")
def reference():
    return colocated_generate([PROMPT_B], MAX_TOKENS)[0]


def _stack(tmp_path, monkeypatch, p0_extra=()):
    reg = start_registry(tmp_path, ttl=TTL)
    lease = ["--lease-ttl", str(TTL), "--lease-fence-margin", "0.3"]
    monkeypatch.setenv("HALFMOON_TEST_PUT_DELAY_S", str(PUT_DELAY))
    p0 = start_worker("prefill", reg.address, tmp_path, "prefill-0", wait=False,
                      extra=[*lease, "--transfer-log", str(tmp_path / "p0.jsonl"), *p0_extra])
    monkeypatch.delenv("HALFMOON_TEST_PUT_DELAY_S")
    p1 = start_worker("prefill", reg.address, tmp_path, "prefill-1", wait=False, extra=lease)
    d = start_worker("decode", reg.address, tmp_path, "decode-0", num_pages=D_PAGES, wait=False,
                     extra=[*lease, "--kv-checksums", "--kv-write-window", str(WINDOW),
                            "--fence-margin", str(MARGIN)])
    procs = [reg, p0, p1, d]
    for p in procs[1:]:
        wait_ready(p)
    return procs


def _batches(path, room):
    if not os.path.exists(path):
        return []
    recs = [json.loads(line) for line in open(path).read().splitlines() if line.strip()]
    return [r for r in recs if r["event"] == "batch" and r["room"] == room]


def _wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _scrape(proc) -> str:
    return urllib.request.urlopen(f"http://{proc.metrics_address}/metrics", timeout=10).read().decode()


def _metric(proc, series: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in _scrape(proc).splitlines()
               if line.startswith(series + " "))


def _releases(d) -> dict[str, float]:
    text = _scrape(d)
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("halfmoon_decode_quarantine_releases_total{")}


def _run(tmp_path, monkeypatch, reference, *, during: bool):
    procs = _stack(tmp_path, monkeypatch, ["--chunked-prefill-size", "32"] if during else [])
    reg, p0, p1, d = procs
    try:
        drv0, drv1 = PDDriver(p0.address, d.address), PDDriver(p1.address, d.address)
        a = drv0.start(PROMPT_A, sampling(MAX_TOKENS))
        tlog = tmp_path / "p0.jsonl"
        _wait(lambda: _batches(tlog, a.result.room), 60, "A's first batch was never submitted")
        if during:  # the first batch is posted after PUT_DELAY, the second is then being delayed
            time.sleep(PUT_DELAY * 1.5)
            assert len(_batches(tlog, a.result.room)) >= 2
        os.kill(p0.pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            a.cancel()
            _wait(lambda: get_load(d.address, "decode").accounting.owned_pages >= LEN // PS, 20,
                  "A's destination pages were not quarantined")
            b = drv1.start(PROMPT_B, sampling(MAX_TOKENS))
            # longer than the lease and D's liveness checks: on the old rule D frees A's pages here
            time.sleep(max(0.0, t_stop + 2 * TTL + 2.5 - time.monotonic()))
            if not during:  # stopped past the fence deadline: D must reuse the pages by its own clock
                res_b = b.wait()
        finally:
            os.kill(p0.pid, signal.SIGCONT)
        if during:
            res_b = b.wait()
        assert a.wait().decode_error is not None
        assert res_b.ok and res_b.tokens == reference, res_b
        # let P0's late batches (refused or, on the old rule, landing) and its answer go through
        _wait(lambda: get_load(p0.address, "prefill").accounting.held_rooms == 0, 30, "P0 kept A")
        again = drv1.generate(PROMPT_B, MAX_TOKENS)
        assert again.ok and again.prefill.pages_sent == 0, again  # every page came from D's radix cache
        assert again.tokens == reference, "B's prompt again: D's cached pages were overwritten"
        assert_idle_accounting([("prefill", p0.address), ("prefill", p1.address), ("decode", d.address)])
        rel = _releases(d)
        assert rel["fence_deadline" if not during else "notice"] == 1, rel
        assert rel["process_gone"] == rel["new_incarnation"] == 0, rel
        assert "released (fence_deadline" in d.log() or during
        recs = [json.loads(line) for line in tlog.read_text().splitlines() if line.strip()]
        answer = [r for r in recs if r["event"] == "notice" and r["room"] == a.result.room]
        assert answer and not answer[-1]["ok"], answer  # the queued ok notice was refused too
        # P0's engine refused the late batch ("write deadline passed" counts as a timeout)
        assert _metric(p0, 'halfmoon_transfer_failures_total{reason="timeout"}') >= 1
    finally:
        for p in reversed(procs):
            p.stop()


def test_prefill_stopped_before_its_write_is_fenced(tmp_path, monkeypatch, reference):
    _run(tmp_path, monkeypatch, reference, during=False)


def test_prefill_stopped_during_its_write_is_fenced(tmp_path, monkeypatch, reference):
    _run(tmp_path, monkeypatch, reference, during=True)
