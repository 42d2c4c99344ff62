"""Greedy output through prefill -> decode equals the co-located engine and transformers.

Real processes (registry, P, D) on loopback UCX, SmolLM2-135M fp32. Prompts of 1, 3, 16 (one
page), 32 (two pages), 37 and ~600 tokens, sent concurrently, twice: the second pass hits both
radix caches (D: some pages, or all of a page-aligned prompt -> 0 pages move). Matrix: page size
16 and 1, decode radix cache on and off. Every request's transfer is checked against P's transfer
log (exactly pages [pre_len/ps, ceil(len/ps)), each once) and the KV accounting must hold after.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import assert_idle_accounting, model_available, start_stack
from tests.integration.pd_driver import (PDDriver, check_transferred_pages, colocated_generate,
                                         transformers_generate)

MAX_TOKENS = 8
LENGTHS = [1, 3, 16, 32, 37, 601]

TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk. He counted the "
        "steps, one hundred and twelve of them, and at the top he wound the clockwork that turned "
        "the great lens. Ships passing the rocky point would see the beam sweep across the water "
        "every eight seconds. In the winter storms he stayed awake through the night, listening "
        "to the wind and writing in his logbook the names of the vessels that passed. ")

pytestmark = pytest.mark.skipif(not model_available(), reason="SmolLM2 is not pulled (halfmoon models pull)")


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    from engine.model_store import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m-instruct")))
    ids = []
    i = 0
    while len(ids) < max(LENGTHS):
        ids += tok.encode(f"Chapter {i}. " + TEXT)
        i += 1
    return [ids[:n] for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(prompts):
    ours = colocated_generate(prompts, MAX_TOKENS)
    hf = transformers_generate(prompts, MAX_TOKENS)
    assert ours == hf, "co-located engine and transformers disagree (engine bug, not PD)"
    return ours


@pytest.mark.parametrize("page_size,decode_radix", [(16, True), (16, False), (1, True), (1, False)],
                         ids=["ps16-radix", "ps16-noradix", "ps1-radix", "ps1-noradix"])
def test_pd_greedy_matches_colocated_and_transformers(tmp_path, prompts, reference, page_size, decode_radix):
    extra = [] if decode_radix else ["--disable-decode-radix-cache"]
    with start_stack(tmp_path, page_size=page_size, decode_extra=extra + ["--kv-checksums"],
                     prefill_extra=["--kv-checksums"]) as st:
        drv = PDDriver(st.prefill_addr, st.decode_addr, timeout_s=180)
        hits = []
        for attempt in range(2):
            results = drv.generate_many(prompts, max_tokens=MAX_TOKENS, concurrency=len(prompts))
            records = st.transfer_records()
            for p, r, ref in zip(prompts, results, reference):
                assert r.ok, (len(p), r.decode_error, r.prefill_error)
                assert r.tokens == ref, (len(p), attempt, r.tokens, ref)
                assert r.finish_reason in ("length", "stop")
                check_transferred_pages(records, r, page_size)
                first = r.chunks[0]
                assert 0 <= first.cached_tokens <= first.prompt_tokens == len(p)
                hits.append((attempt, len(p), first.decode_prefix_tokens, first.cached_tokens))
        d_hits = [h[2] for h in hits if h[0] == 1]
        if decode_radix:
            # pass 2: every prompt's full pages are cached on D; a page-aligned prompt moves 0 pages
            for (_, n, pre, _) in [h for h in hits if h[0] == 1]:
                assert pre == n // page_size * page_size, hits
        else:
            assert not any(d_hits), hits
        drv.close()
        assert_idle_accounting(st)
