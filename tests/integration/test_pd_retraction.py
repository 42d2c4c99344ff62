"""On-demand decode memory with real processes: retraction under a tiny pool, and many chats
without ``max_tokens`` on ``halfmoon up``'s default pool.

* P → D with a 24-page decode pool, a 16-token reserve and a projection that admits whatever
  fits: 8 requests that each end at 6 pages
  cannot all hold their KV at once, so D retracts and resumes (recomputing tails itself) again and
  again; every request's greedy tokens must still equal the co-located engine's. The same stack
  has a second D with that pool and no decode radix cache (a resume recomputes from scratch).
* The same stack with ``--queue-keepalive 1``: while one long request holds most of the pool, a
  second request waits in D's admission queue; its Generate stream gets empty keepalive chunks
  before its first token (none after), then exactly the co-located engine's tokens.
* 16 concurrent OpenAI chats without ``max_tokens`` (each may use the rest of the 8192-token
  context) through the router on ``halfmoon up``'s default stack: at least half of them must be
  in D's running batch at once (not all: on the shared 2 cores the shortest answers can end before
  the last chat's prefill is done; one CI run peaked at 11) and all finish within a bounded time.
  With D reserving ``prompt + max_tokens - 1`` slots per request they ran one at a time (see
  docs/architecture.md, Decode memory).
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.conftest import MODEL, assert_idle_accounting, get_load, model_available, start_stack
from tests.integration.pd_driver import PDDriver, colocated_generate, sampling

pytestmark = pytest.mark.skipif(not model_available(), reason="SmolLM2 is not pulled (halfmoon models pull)")

TEXT = ("The harbour master kept a ledger of every ship that came in, its cargo, its crew and the "
        "weather on the day it arrived. ")


def scrape(metrics_address: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


TINY_PAGES = 24  # D's pool in pages of 16 tokens


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from engine.model_store import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(MODEL)))


RETRACTION_FLAGS = ["--num-reserved-decode-tokens", "16", "--max-retractions", "4",
                    "--init-new-token-ratio", "0.01", "--min-new-token-ratio", "0.01"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One stack for the module's P -> D tests: decode-0 with the tiny pool and queue keepalives,
    and "decode-nocache", the same pool without the decode radix cache (one registry and P for both)."""
    with start_stack(tmp_path_factory.mktemp("tiny"), decode_pages=TINY_PAGES,
                     decode_extra=[*RETRACTION_FLAGS, "--queue-keepalive", "1"],
                     more_decodes={"decode-nocache": ["--disable-decode-radix-cache", *RETRACTION_FLAGS]}) as st:
        yield st


HEAVY_MAX_TOKENS = 48


@pytest.fixture(scope="module")
def heavy(tok):
    """The 8 prompts of the heavy-retraction tests and the co-located engine's greedy tokens
    (computed once for both decode workers)."""
    prompts = [tok.encode(f"Entry {i}. " + TEXT)[:40] for i in range(8)]
    return prompts, colocated_generate(prompts, HEAVY_MAX_TOKENS)


def _heavy_retraction_equals_colocated(stack, decode, heavy):
    prompts, ref = heavy
    drv = PDDriver(stack.prefill_addr, decode.address, timeout_s=80)
    results = drv.generate_many(prompts, max_tokens=HEAVY_MAX_TOKENS, concurrency=len(prompts))
    drv.close()
    for r, want in zip(results, ref):
        assert r.ok, (r.decode_error, r.prefill_error)
        assert r.tokens == want
    assert scrape(decode.metrics_address, "halfmoon_decode_retractions_total") >= 2
    assert scrape(decode.metrics_address, "halfmoon_decode_resume_recomputed_tokens_total") > 0
    assert_idle_accounting(stack)


def test_greedy_under_heavy_retraction_equals_colocated(tiny, heavy):
    _heavy_retraction_equals_colocated(tiny, tiny.decode, heavy)


def test_greedy_under_heavy_retraction_without_the_decode_radix_cache(tiny, heavy):
    """No radix cache on D: a retracted request keeps nothing, and its resume recomputes prompt +
    generated tokens from scratch; the tokens must still be the co-located engine's."""
    _heavy_retraction_equals_colocated(tiny, tiny.decodes["decode-nocache"], heavy)


OTHER_TEXT = ("A lighthouse keeper wrote down the colour of the sea each morning, the birds she saw and "
              "the boats that passed her rock. ")


def test_queued_request_gets_keepalives_then_reference_tokens(tiny, tok):
    # A: 176 prompt + 120 output tokens (19 of the 24 pages at the end), admitted with 12 pages;
    # B: 200 prompt tokens + the 16-token reserve = 14 pages, sharing no page with A: B can only be
    # admitted once A is done, ~120 decode steps (seconds on a CPU) after A's first token
    a_prompt = tok.encode(TEXT * 8)[:176]
    b_prompt = tok.encode(OTHER_TEXT * 8)[:200]
    want = colocated_generate([b_prompt], 12)[0]
    drv = PDDriver(tiny.prefill_addr, tiny.decode_addr, timeout_s=120)
    try:
        a = drv.start(a_prompt, sampling(120, ignore_eos=True))
        assert a.first_chunk(60), "A got no first token"
        b = drv.start(b_prompt, sampling(12))
        rb, ra = b.wait(), a.wait()
    finally:
        drv.close()
    assert ra.ok and len(ra.tokens) == 120, (ra.decode_error, ra.prefill_error, len(ra.tokens))
    assert rb.ok, (rb.decode_error, rb.prefill_error)
    assert rb.keepalives and set(rb.keepalives) == {0}, rb.keepalives  # only before its first token
    assert rb.tokens == want
    assert set(ra.keepalives) <= {0}
    assert_idle_accounting(tiny)


# greedy answers of 10-50 tokens, each ending on EOS (a bounded run; no max_tokens is sent)
CHATS = ["Say hi.", "Name a color.", "Name a fruit.", "Name a vegetable.", "Name a river.", "Name a city.",
         "Name an animal.", "Name a sport.", "Name a number.", "Name a month.", "Say hello.",
         "Name a planet.", "Name a tree.", "Name a shape.", "Name a metal.", "Name an insect."]


def test_16_chats_without_max_tokens_run_together(tmp_path):
    import openai

    from halfmoon.launcher import Stack, StackConfig

    cfg = StackConfig(model=MODEL, base_port=0, torch_threads=1, log_dir=str(tmp_path), ready_timeout=300,
                      worker_args=["--transport", "sm"])  # the default pools and batch sizes
    with Stack(cfg) as st:
        decode = st.endpoints["decode"][0]["grpc"]
        client = openai.OpenAI(base_url=f"http://{st.endpoints['router']['http']}/v1", api_key=st.endpoints["api_key"],
                               timeout=75, max_retries=0)
        creds = st.credentials.client()
        peak = [0]
        done = threading.Event()

        def watch():
            while not done.is_set():
                peak[0] = max(peak[0], get_load(decode, "decode", creds).running_requests)
                time.sleep(0.05)

        def chat(text):
            r = client.chat.completions.create(model=MODEL, temperature=0,
                                               messages=[{"role": "user", "content": text}])
            return r.choices[0].finish_reason, r.usage.completion_tokens

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0 = time.monotonic()
        try:
            with ThreadPoolExecutor(len(CHATS)) as ex:
                out = list(ex.map(chat, CHATS))
        finally:
            done.set()
            watcher.join()
        elapsed = time.monotonic() - t0
        assert all(reason == "stop" for reason, _ in out), out
        # a whole-context reserve admits one at a time (peak 2 measured); the default admits them together
        assert peak[0] >= len(CHATS) // 2, f"at most {peak[0]} chats decoded together ({elapsed:.1f} s)"
        assert_idle_accounting([("decode", decode), ("prefill", st.endpoints["prefill"][0]["grpc"])],
                               credentials=creds)
