"""``--kv-checksums`` with tensor-parallel prefill and decode workers: real processes (registry, two
P and two D workers, the TP=2 ones with their rank processes under gloo), real UCX between every
(P rank, D rank) pair, the default model (SmolLM2-135M: 3 kv heads, so TP=2 holds 2 + 1).

One stack serves three pairs: P TP=2 -> D TP=1, P TP=1 -> D TP=2 and P TP=2 -> D TP=2. D checks P's
per-(page, kv head) checksums of each delta on every rank (a notice without them, or with a wrong
one, fails the room), so greedy tokens equal to the co-located engine's mean every head's sums
matched. Then two corruptions on FOLLOWER ranks (kv head 2 only; rank 0's heads untouched):

* in transit: P rank 1's source page changes after that rank summed it and before its puts (held
  back by the ``HALFMOON_TEST_PUT_DELAY_S`` test hook on a third P, TP=2): D's rank 1 sums differ
  from the notice's, so D fails the room DATA_LOSS naming head 2 and rank 1; the request again
  then succeeds;
* at rest: a stray write into a cached page of D's rank 1 is caught when a prefix hit reuses the
  page: evicted with what follows, the prompt recomputed by P, the tokens still right, and the
  recomputed pages verified again on the next hit.

KV accounting on every rank of every worker at the end.
"""

from __future__ import annotations

import json
import os
import time

import grpc
import psutil
import pytest

from pd_common.head_slices import PageShape
from protos import registry_pb2, registry_pb2_grpc
from tests.integration.conftest import (assert_clean_log, assert_idle_accounting, model_available, start_stack,
                                        start_worker, wait_ready)
from tests.integration.pd_driver import PDDriver
from tests.integration.test_pd_tp import MAX_TOKENS, prompts, reference, tokenizer  # noqa: F401 (fixtures)
from transfer_svc.rank_regions import rank_regions

# pair -> (prefill worker id, decode worker id)
PAIRS = {"p2-d1": ("prefill-0", "decode-0"), "p1-d2": ("prefill-1", "decode-1"), "p2-d2": ("prefill-0", "decode-1")}
SUMS = ["--kv-checksums"]
PUT_DELAY = 5.0  # prefill-2's puts (every rank's) wait this long after their submit


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not model_available():
        pytest.skip("default model not pulled")
    logs = tmp_path_factory.mktemp("tpsums")
    # prefill-1 has no --kv-checksums: it sends them because D asks (KVDestination.want_checksums);
    # decode-1 runs the overlap schedule, so its rank-sum queries go out between overlapped steps
    with start_stack(logs, prefill_extra=["--tp", "2", *SUMS], decode_extra=SUMS,
                     more_decodes={"decode-1": ["--tp", "2", "--overlap-schedule", "on", *SUMS]}) as st:
        more = [start_worker("prefill", st.registry.address, logs, "prefill-1", wait=False,
                             extra=["--transfer-log", str(logs / "transfer-p1.jsonl")])]
        os.environ["HALFMOON_TEST_PUT_DELAY_S"] = str(PUT_DELAY)  # copied by the spawn, inherited by rank 1
        try:
            more.append(start_worker("prefill", st.registry.address, logs, "prefill-2", wait=False,
                                     extra=["--tp", "2", "--transfer-log", str(logs / "transfer-p2.jsonl")]))
        finally:
            del os.environ["HALFMOON_TEST_PUT_DELAY_S"]
        try:
            for p in more:
                wait_ready(p)
            st.workers = {"prefill-0": st.prefill, "prefill-1": more[0], "prefill-2": more[1], **st.decodes}
            yield st
        finally:
            for p in more:
                p.stop()


def _records(stack, prefill: str) -> list[dict]:
    path = stack.transfer_log if prefill == "prefill-0" else stack.log_dir / f"transfer-p{prefill[-1]}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _batches(stack, prefill: str, room: int) -> list[dict]:
    return [b for b in _records(stack, prefill) if b.get("room") == room and b["event"] == "batch"]


def _driver(stack, pair: str) -> PDDriver:
    p, d = PAIRS[pair]
    return PDDriver(stack.workers[p].address, stack.workers[d].address, timeout_s=180)


@pytest.mark.parametrize("pair", list(PAIRS))
def test_greedy_tokens_with_checksums_equal_the_colocated_engine(stack, pair, prompts, reference):
    drv = _driver(stack, pair)
    try:
        got = drv.generate_many(prompts[:3], MAX_TOKENS, concurrency=3)
    finally:
        drv.close()
    assert all(r.ok for r in got), [(r.decode_error, r.prefill_error) for r in got]
    assert [r.tokens for r in got] == reference[:3]
    records = _records(stack, PAIRS[pair][0])
    for r in got:  # every batch went rank by rank (P or D runs two ranks)
        batches = [b for b in records if b.get("room") == r.room and b["event"] == "batch"]
        assert batches and all(b["rank_writes"] for b in batches), batches
    d_log = stack.workers[PAIRS[pair][1]].log()
    assert "checksum mismatch" not in d_log
    assert f"overlap schedule: {'on' if PAIRS[pair][1] == 'decode-1' else 'off'}" in d_log


def _corrupt_follower_page(stack, worker: str, page: int) -> int:
    """Flip the first 64 bytes of physical ``page`` in ``worker``'s rank 1 pool (layer 0 K, token 0:
    kv head 2, the rank's only head), as a stray write would; returns the rank's pid."""
    with grpc.insecure_channel(stack.registry.address) as ch:
        desc = registry_pb2_grpc.RegistryStub(ch).GetSegment(
            registry_pb2.GetSegmentRequest(name=worker), timeout=10).worker.segment
    region = rank_regions(desc)[1]
    assert (region.head_start, region.head_end) == (2, 3)
    addr = region.base + page * PageShape.from_layout(desc.kv_layout).stride(region.heads)
    follower = psutil.Process(stack.workers[worker].pid).children()[0]
    assert "pd_common.tp_rank" in " ".join(follower.cmdline())
    with open(f"/proc/{follower.pid}/mem", "r+b", buffering=0) as mem:
        mem.seek(addr)
        old = mem.read(64)
        mem.seek(addr)
        mem.write(bytes(b ^ 0x5A for b in old))
    return follower.pid


def test_a_prefill_followers_page_changed_in_transit_fails_the_room_naming_the_rank(stack, prompts, reference):
    drv = PDDriver(stack.workers["prefill-2"].address, stack.workers["decode-1"].address, timeout_s=180)
    try:
        call = drv.start(prompts[0])  # 5 tokens: one partial page, not cached on either side
        deadline = time.monotonic() + 60
        while not _batches(stack, "prefill-2", call.result.room):
            assert time.monotonic() < deadline, "prefill-2 never submitted the batch"
            time.sleep(0.05)
        (batch,) = _batches(stack, "prefill-2", call.result.room)
        # rank 1 summed its head when it took the write command (before the record was logged);
        # its puts wait PUT_DELAY s after that: change the page in between
        time.sleep(1.5)
        _corrupt_follower_page(stack, "prefill-2", batch["src_pages"][0])
        bad = call.wait()
        assert not bad.ok and bad.decode_error is not None, bad
        code, details = bad.decode_error
        assert code == "DATA_LOSS" and "KV checksum mismatch" in details, bad.decode_error
        assert "kv head 2 (rank 1)" in details, details  # found by D's follower, against P's follower
        assert "kv head 2 on rank 1" in stack.workers["decode-1"].log()
        again = drv.generate(prompts[0], MAX_TOKENS)  # a retry (the router's, here the test's) succeeds
        assert again.ok and again.tokens == reference[0], (again.decode_error, again.prefill_error)
    finally:
        drv.close()


def test_a_corrupted_cached_page_on_a_follower_rank_is_evicted_and_recomputed(stack, prompts, reference):
    prefill, decode = PAIRS["p1-d2"]
    d = stack.workers[decode]
    drv = _driver(stack, "p1-d2")
    try:
        first = drv.generate(prompts[3], MAX_TOKENS)
        assert first.ok and first.tokens == reference[3], (first.decode_error, first.prefill_error)
        batches = [b for b in _records(stack, prefill) if b.get("room") == first.room and b["event"] == "batch"]
        assert batches[0]["pre_len"] == 0 and batches[0]["logical_pages"][0] == 0
        page = batches[0]["dst_pages"][0]  # D's page of the shared prefix's first 16 tokens
        _corrupt_follower_page(stack, decode, page)

        second = drv.generate(prompts[4], MAX_TOKENS)  # shares that page: D's prefix hit re-verifies it
        assert second.ok and second.tokens == reference[4], (second.decode_error, second.prefill_error)
        assert second.chunks[0].decode_prefix_tokens == 0  # the bad page and what follows were evicted
        resent = [b for b in _records(stack, prefill) if b.get("room") == second.room and b["event"] == "batch"]
        assert resent[0]["pre_len"] == 0 and resent[0]["logical_pages"][0] == 0  # P recomputed and resent it
        log = d.log()
        assert log.count("KV checksum mismatch on cached page") == 1, log[-4000:]
        assert f"KV checksum mismatch on cached page {page} (logical page 0" in log
        assert "kv head 2 on rank 1" in log  # the follower's head, found by its own sums

        third = drv.generate(prompts[4], MAX_TOKENS)  # the recomputed pages were recorded anew
        assert third.ok and third.tokens == reference[4]
        assert third.chunks[0].decode_prefix_tokens >= 16
        assert d.log().count("KV checksum mismatch on cached page") == 1
    finally:
        drv.close()
    assert_idle_accounting([("prefill" if w.startswith("prefill") else "decode", proc.address)
                            for w, proc in stack.workers.items()])
    for proc in stack.workers.values():
        assert_clean_log(proc)

