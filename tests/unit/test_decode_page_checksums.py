"""D's page checksums (``--kv-checksums``) in one process, with the stub P of
``tests/unit/decode_harness.py``: a cached page whose bytes changed after it entered the radix cache is
found when a prefix hit would reuse it, taken out of the tree with what follows it, and recomputed
(P gets a shorter ``pre_len``); the output still equals the co-located engine's."""

from __future__ import annotations

import logging

import pytest

from telemetry import metrics as M
from tests.unit.decode_harness import PS, Decode, model, outcome, reference  # noqa: F401

PROMPT = [5, 17, 33, 2, 41, 8, 60, 12, 9, 70, 3, 44, 51]  # 13 tokens: 3 full pages + 1


def cached_pages(d, tokens) -> list[int]:
    slots, _ = d.sched.kv.cache.match_prefix(tokens)
    return (slots[::PS] // PS).tolist()


def tree_pages(d) -> set[int]:
    out, stack = set(), [d.sched.kv.cache.root]
    while stack:
        n = stack.pop()
        out |= set((n.value[::PS] // PS).tolist())
        stack.extend(n.children.values())
    return out


# page 1 came from P (recorded at the notice commit); page 3 holds decode tokens D computed itself
# (recorded when the first request finished)
@pytest.mark.parametrize("bad", [1, 3])
def test_corrupt_cached_page_is_evicted_and_recomputed(model, reference, caplog, bad):
    d = Decode(model, checksums=True)
    a = d.submit(PROMPT, 6)
    d.tick()
    ref_a = reference(PROMPT, 6)
    d.prefill(a, ref_a[0], checksums=True)
    d.run_until_done(a)
    assert outcome(a) == (ref_a, None)
    prompt = (PROMPT + ref_a)[:17]                 # 4 full pages cached: prompt + decode tokens
    pages = cached_pages(d, prompt)
    assert len(pages) == 4
    pool = d.runner.kv_pool
    pool.k_pages(0)[pages[bad]] += 1.0             # the page's bytes change in D's pool
    before = M.DECODE_KV_CHECKSUM_MISMATCHES._value.get()
    ref = reference(prompt, 5)
    with caplog.at_level(logging.WARNING, logger="halfmoon.decode"):
        b = d.submit(prompt, 5)
        d.tick()
    assert M.DECODE_KV_CHECKSUM_MISMATCHES._value.get() - before == 1
    warnings = [r for r in caplog.records if "checksum mismatch" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    # only the good pages before the bad one are reused; P recomputes the rest
    dest = d.net.dests[b.room]
    assert b.lease.pre_len == dest.pre_len == bad * PS
    assert pages[bad] not in tree_pages(d) and cached_pages(d, prompt) == pages[:bad]
    d.sched.kv.cache.check_invariants()
    d.prefill(b, ref[0], checksums=True)
    d.run_until_done(b)
    assert outcome(b) == (ref, None)
    d.assert_idle()


def test_good_pages_are_reused_without_a_mismatch(model, reference):
    d = Decode(model, checksums=True)
    ref = reference(PROMPT, 4)
    for i in range(2):
        before = M.DECODE_KV_CHECKSUM_MISMATCHES._value.get()
        job = d.submit(PROMPT, 4)
        d.tick()
        assert job.lease.pre_len == 12 * i
        d.prefill(job, ref[0], checksums=True)
        d.run_until_done(job)
        assert outcome(job) == (ref, None)
        assert M.DECODE_KV_CHECKSUM_MISMATCHES._value.get() == before
    d.assert_idle()
