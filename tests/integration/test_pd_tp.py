"""Tensor-parallel prefill and decode workers (``--tp``): real processes (registry, P and D with
their rank processes under gloo, one torch thread each), real UCX between every (P rank, D rank)
pair, the default model (SmolLM2-135M: 3 kv heads, so TP=2 splits them 2 + 1). One stack per
(P TP, D TP) pair: 2 -> 1, 1 -> 2, 2 -> 2.

* greedy tokens equal the co-located engine on one rank, one at a time and as one batch (with D's
  overlap schedule on for 2 -> 2);
* a second prompt sharing a prefix moves exactly its delta pages (the decode radix cache on), and
  every (P rank, D rank) write of a batch moves all of its pages, of the heads that D rank holds
  (each D head exactly once); idle accounting on P and D afterwards (the ranks 1..N-1 own no pages:
  rank 0's allocator places every page of every rank);
* a long prompt (a delta of 67 pages) moves as one put per page per rank write (the strided per-row
  plan this replaced was 960 per page: seconds per batch): whole P pages head-blocked into D's
  (2 -> 1, D unblocks them), P's gathered head slices into whole D pages (1 -> 2), whole pages
  (2 -> 2); tokens equal the co-located engine's;
* an n=3 request forks on D: every sample's tokens equal the co-located engine's (each D rank
  copies its heads of the partial last page);
* a follower rank SIGKILLed mid-request: its worker exits within seconds and deregisters, the
  request ends instead of hanging, the peer worker keeps serving and ends idle.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import psutil
import pytest

from engine.engine import Engine
from engine.sampling_params import SamplingParams
from protos import registry_pb2, registry_pb2_grpc
from tests.integration.conftest import (assert_clean_log, assert_idle_accounting, get_load, model_available,
                                        start_stack)
from tests.integration.pd_driver import PDDriver, sampling

PAGE = 16
MAX_TOKENS = 8
TEXTS = ["The capital of France is", "def fibonacci(n):\n    ",
         "Once upon a time, in a land far away, there lived a king who had three daughters. The youngest"]
LONG_PAGES = 67  # the long prompt's delta: past 64 pages of 16 tokens
SHARED = ("A long shared system prompt: you are a careful assistant who answers questions about "
          "geography, history and science in short sentences. Question:")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """TEXTS, then two prompts sharing SHARED's first pages, then a prompt of LONG_PAGES pages."""
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    ids += [tokenizer(SHARED + q)["input_ids"] for q in (" What is the tallest mountain?", " Who built Rome?")]
    words = " ".join(f"Record {i}: the river {i % 7} flows past town {i * 13 % 97}." for i in range(200))
    long = tokenizer(words)["input_ids"][:LONG_PAGES * PAGE - 5]
    ids.append(long + tokenizer(" Which town comes last?")["input_ids"][:5])
    assert -(-len(ids[-1]) // PAGE) == LONG_PAGES
    return ids


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    eng = Engine(str(model_dir), page_size=PAGE, num_pages=160, max_running_requests=8, torch_threads=1)
    try:
        return [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))]
    finally:
        eng.close()


@pytest.fixture(scope="module", params=[(2, 1), (1, 2), (2, 2)], ids=lambda t: f"p{t[0]}-d{t[1]}")
def stack(request, tmp_path_factory):
    if not model_available():
        pytest.skip("default model not pulled")
    p_tp, d_tp = request.param
    # TP=2 -> TP=2 runs D's overlap schedule (its followers run batches whose input ids rank 0
    # fed from the device); TP=1 -> TP=2 keeps it off, the CPU default
    overlap = ["--overlap-schedule", "on"] if (p_tp, d_tp) == (2, 2) else []
    with start_stack(tmp_path_factory.mktemp(f"tp{p_tp}{d_tp}"), prefill_extra=["--tp", str(p_tp)],
                     decode_extra=["--tp", str(d_tp), *overlap]) as st:
        st.tp = request.param
        st.overlap = bool(overlap)
        st.driver = PDDriver(st.prefill_addr, st.decode_addr, timeout_s=120)
        yield st
        st.driver.close()


def _heads(tp: int) -> list[tuple[int, int]]:
    return [(0, 3)] if tp == 1 else [(0, 2), (2, 3)]  # engine/distributed/shard.py for 3 kv heads


def test_greedy_tokens_equal_the_colocated_engine(stack, prompts, reference):
    got = [stack.driver.generate(p, MAX_TOKENS) for p in prompts[:3]]
    assert all(r.ok for r in got), [(r.decode_error, r.prefill_error) for r in got]
    assert [r.tokens for r in got] == reference[:3]


def test_concurrent_greedy_batches_equal_the_colocated_engine(stack, prompts, reference):
    # one decode batch of three: under the overlap schedule (p2-d2) each step's input ids are the
    # previous step's argmax on rank 0's device, and the follower must run that same batch
    got = stack.driver.generate_many(prompts[:3], MAX_TOKENS, concurrency=3)
    assert all(r.ok for r in got), [(r.decode_error, r.prefill_error) for r in got]
    assert [r.tokens for r in got] == reference[:3]
    assert f"overlap schedule: {'on' if stack.overlap else 'off'}" in stack.decode.log()


def test_a_shared_prefix_moves_only_the_delta_through_every_rank_pair(stack, prompts, reference):
    first, second = stack.driver.generate(prompts[3], MAX_TOKENS), stack.driver.generate(prompts[4], MAX_TOKENS)
    assert first.ok and second.ok, (first.decode_error, second.decode_error)
    assert [first.tokens, second.tokens] == reference[3:5]
    p_tp, d_tp = stack.tp
    for res, prompt in ((first, prompts[3]), (second, prompts[4])):
        batches = res.batches = [r for r in stack.transfer_records() if r["event"] == "batch" and r["room"] == res.room]
        pre_len = batches[0]["pre_len"]
        pages = [p for b in batches for p in b["logical_pages"]]
        assert pages == list(range(pre_len // PAGE, -(-len(prompt) // PAGE)))  # exactly the delta, once
        for b in batches:
            writes = b["rank_writes"]
            assert {w[0] for w in writes} == set(range(p_tp)) and all(w[4] == len(b["logical_pages"]) for w in writes)
            for d_rank, (lo, hi) in enumerate(_heads(d_tp)):
                held = sorted(h for w in writes if w[1] == d_rank for h in range(w[2], w[3]))
                assert held == list(range(lo, hi)), (d_rank, writes)
    hit = second.batches[0]["pre_len"]
    assert hit >= PAGE and first.batches[0]["pre_len"] == 0  # the second prompt hit D's radix cache
    assert second.chunks[0].decode_prefix_tokens == hit
    page_bytes = 2 * 30 * PAGE * 3 * 64 * 4  # SmolLM2: 30 layers, 3 kv heads of 64, float32: every rank's
    assert second.chunks[-1].kv_bytes_transferred == second.chunks[-1].kv_pages_transferred * page_bytes
    assert_idle_accounting(stack)
    for proc in (stack.prefill, stack.decode):
        assert_clean_log(proc)


def test_a_long_delta_moves_one_put_per_page_per_rank_write(stack, prompts, reference):
    res = stack.driver.generate(prompts[5], MAX_TOKENS)
    assert res.ok, (res.decode_error, res.prefill_error)
    assert res.tokens == reference[5]
    p_tp, d_tp = stack.tp
    batches = [r for r in stack.transfer_records() if r["event"] == "batch" and r["room"] == res.room]
    assert [p for b in batches for p in b["logical_pages"]] == list(range(LONG_PAGES))  # no hit: all of it
    # [p_rank, d_rank, head_start, head_end, pages, descriptors, staged, blocked]
    modes = {(2, 1): (0, 1), (1, 2): (1, 0), (2, 2): (0, 0)}[(p_tp, d_tp)]
    for b in batches:
        n = len(b["logical_pages"])
        for w in b["rank_writes"]:
            assert w[4] == n and w[5] == n, w  # one descriptor per page (strided: 2 * 30 * 16 per page)
            assert (w[6], w[7]) == modes, w
    notice = [r for r in stack.transfer_records() if r["event"] == "notice" and r["room"] == res.room]
    assert notice and notice[0]["ok"] and notice[0]["pages_sent"] == LONG_PAGES
    assert res.chunks[-1].kv_pages_transferred == LONG_PAGES
    assert_idle_accounting(stack)


def test_n_samples_fork_on_every_decode_rank(stack, prompts, reference):
    # D forks an n=3 request: the partial last page is copied per sample on EVERY rank (each holds
    # its kv heads); copied on rank 0 alone, samples 1.. read a stale page on D --tp 2 (wrong tokens)
    import secrets

    from protos import decode_pb2, prefill_pb2

    room, params = secrets.randbits(62) or 1, sampling(MAX_TOKENS)
    prompt = prompts[2]  # 20+ tokens: a partial last page of its own
    assert len(prompt) % PAGE
    d = stack.driver
    stream = d.decode.Generate(decode_pb2.DecodeRequest(request_id=f"n3-{room}", room=room, input_ids=prompt,
                                                        sampling=params, prefill_address=d.prefill_addr, n=3),
                               timeout=120)
    pfut = d.prefill.Prefill.future(prefill_pb2.PrefillRequest(request_id=f"n3-{room}", room=room,
                                                               input_ids=prompt, sampling=params, n=3), timeout=120)
    got: dict[int, list[int]] = {}
    for chunk in stream:
        got.setdefault(chunk.index, []).extend(chunk.token_ids)
    pfut.result(timeout=120)
    assert got == {i: reference[2] for i in range(3)}  # greedy: every sample is the reference
    assert_idle_accounting(stack)


def test_the_descriptor_names_every_rank_process(stack):
    """Each follower rank posts its own puts, so a peer proves the worker's death only once every
    rank's process is gone: the published descriptor names them all (pid and start ticks)."""
    from transfer_svc.liveness import pid_start_ticks

    p_tp, d_tp = stack.tp
    for worker, tp in ((stack.prefill, p_tp), (stack.decode, d_tp)):
        with grpc.insecure_channel(stack.registry.address) as ch:
            desc = registry_pb2_grpc.RegistryStub(ch).GetSegment(
                registry_pb2.GetSegmentRequest(name=worker.name), timeout=10).worker.segment
        followers = [c for c in psutil.Process(worker.pid).children() if "pd_common.tp_rank" in " ".join(c.cmdline())]
        assert len(followers) == tp - 1
        assert desc.pid == worker.pid and desc.pid_start_ticks == pid_start_ticks(worker.pid)
        named = sorted((r.pid, r.pid_start_ticks) for r in desc.regions if r.rank > 0)
        assert named == sorted((c.pid, pid_start_ticks(c.pid)) for c in followers), desc


def test_a_killed_rank_takes_its_worker_down_and_nothing_hangs(stack, prompts):
    p_tp, d_tp = stack.tp
    victim, peer, service = (stack.decode, stack.prefill, "prefill") if d_tp > 1 else \
        (stack.prefill, stack.decode, "decode")
    follower = psutil.Process(victim.pid).children()[0]
    assert "pd_common.tp_rank" in " ".join(follower.cmdline())
    # D killed mid-decode of a long request; P killed while D decodes a short one (P's part is done)
    call = stack.driver.start(prompts[2], sampling(400 if victim is stack.decode else 24, ignore_eos=True))
    assert call.first_chunk(60)
    done = threading.Event()
    threading.Thread(target=lambda: (call.wait(), done.set()), daemon=True).start()
    t0 = time.monotonic()
    follower.send_signal(signal.SIGKILL)
    assert victim.popen.wait(15) == 1, victim.log()[-3000:]
    assert time.monotonic() - t0 < 15
    assert f"rank 1 (pid {follower.pid}) exited with signal 9" in victim.log()
    assert "Traceback" not in victim.log(), victim.log()[-4000:]  # one line per failure, no traceback
    assert done.wait(30), "the request hung after a rank died"
    if victim is stack.decode:  # D held the stream: it ends with an error, not a hang
        assert call.result.decode_error is not None or call.result.finish_reason == "abort"
    with grpc.insecure_channel(stack.registry.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            registry_pb2_grpc.RegistryStub(ch).GetSegment(registry_pb2.GetSegmentRequest(name=victim.name), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND  # deregistered, not left to lease expiry
    assert get_load(peer.address, service).worker_id  # the peer still serves
    assert_idle_accounting([(service, peer.address)])


