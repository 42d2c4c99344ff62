"""Greedy output through prefill -> decode equals the co-located engine and transformers.

Real processes (registry, one P, two D's: decode radix cache on / off) on loopback UCX, SmolLM2-135M
fp32, page size 16 and 1. Prompts of 1, 3, 16 (one page), 32 (two pages), 37 and ~600 tokens, sent
concurrently, twice per D: the second pass hits the radix caches, so the deltas cover D hits of
0, some and all pages (a page-aligned, fully cached prompt moves 0 pages) and P hits below, equal
to and above D's. Every request's transfer is checked against P's transfer log (exactly the pages
[pre_len/ps, ceil(len/ps)), each once, one ok notice), with page checksums verified on D, and
the KV accounting must hold afterwards."""

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


@pytest.mark.parametrize("page_size,kv_layout", [(16, "page_major"), (1, "layer_major")],
                         ids=["ps16-page_major", "ps1-layer_major"])
def test_pd_greedy_matches_colocated_and_transformers(tmp_path, prompts, reference, page_size, kv_layout):
    """One P serves two D's: decode-0 (decode radix cache on) and decode-1 (off), all in ``kv_layout``
    (a page run moves as 1 put in page_major, 2 * 30 layers in layer_major); decode-x, in the other
    layout, gets a clear error naming --kv-layout."""
    layout = ["--kv-layout", kv_layout]
    other = ["--kv-layout", "layer_major" if kv_layout == "page_major" else "page_major"]
    with start_stack(tmp_path, page_size=page_size, decode_extra=["--kv-checksums", *layout],
                     prefill_extra=["--kv-checksums", *layout],
                     more_decodes={"decode-1": ["--kv-checksums", "--disable-decode-radix-cache", *layout],
                                   "decode-x": other}) as st:
        drv = PDDriver(st.prefill_addr, st.decodes["decode-x"].address, timeout_s=60)
        bad = drv.generate(prompts[3], max_tokens=MAX_TOKENS)
        drv.close()
        assert not bad.ok and "--kv-layout" in str(bad.decode_error) + str(bad.prefill_error), bad
        per_run = 1 if kv_layout == "page_major" else 2 * 30  # SmolLM2-135M: 30 layers
        hits = []  # (decode worker, pass, prompt len, D pre_len, P cached tokens)
        for wid, d in st.decodes.items():
            if wid == "decode-x":
                continue
            drv = PDDriver(st.prefill_addr, d.address, timeout_s=180)
            for attempt in range(2):
                results = drv.generate_many(prompts, max_tokens=MAX_TOKENS, concurrency=len(prompts))
                records = st.transfer_records()
                for p, r, ref in zip(prompts, results, reference):
                    assert r.ok, (wid, len(p), r.decode_error, r.prefill_error)
                    assert r.tokens == ref, (wid, len(p), attempt, r.tokens, ref)
                    check_transferred_pages(records, r, page_size, per_run)
                    first = r.chunks[0]
                    assert 0 <= first.cached_tokens <= first.prompt_tokens == len(p)
                    assert r.last.completion_tokens == len(r.tokens)
                    hits.append((wid, attempt, len(p), first.decode_prefix_tokens, first.cached_tokens))
            drv.close()
        ps = page_size
        second = [h for h in hits if h[0] == "decode-0" and h[1] == 1]
        # pass 2 on the radix decode: every prompt's full pages are cached on D
        assert all(pre == n // ps * ps for _, _, n, pre, _ in second), hits
        assert not any(h[3] for h in hits if h[0] == "decode-1"), hits
        # the delta cases the transfer check above covered: D hit of 0, some and all pages ...
        assert any(pre == 0 for *_, pre, _ in hits)
        assert any(n % ps == 0 and pre == n for _, _, n, pre, _ in second)   # all: 0 pages move
        if ps > 1:
            assert any(0 < pre < n for _, _, n, pre, _ in second)            # some
            # ... and P hits below, equal to and above D's
            assert any(p_hit < pre for *_, pre, p_hit in second)
            assert any(p_hit == pre > 0 for *_, pre, p_hit in second)
        assert any(p_hit > pre for *_, pre, p_hit in hits)
        assert_idle_accounting(st)
