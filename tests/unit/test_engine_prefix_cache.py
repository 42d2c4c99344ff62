"""Co-located engine with the radix cache on (real SmolLM2-135M weights, fp32, CPU).

* a second pass over the same prompts gives identical greedy tokens and reports cached tokens;
  the same tokens as an engine with the cache disabled; 0 <= cached_tokens <= prompt_tokens;
* multi-turn: turn 2 reuses exactly the committed pages of turn 1 (the last sampled token of turn 1
  has no K/V), for page sizes 1 and 4;
* a small pool under pressure evicts (counted by the tree) and still gives the same tokens;
* a request larger than the pool gets ResourceExhaustedError before anything is allocated;
* after all requests end: free + evictable + protected == pool pages, every lock count is 0.
"""

from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.errors import ResourceExhaustedError
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SHARED = ("You are a concise assistant. Answer in one short sentence and do not add anything else. "
          "Question: ")
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "Name a prime number.",
             "What do bees make?"]


@pytest.fixture(scope="module")
def weights(model_dir):
    eng = Engine("smollm2-135m-instruct", page_size=4, num_pages=512, max_running_requests=8,
                 torch_threads=1)
    return eng, (eng.runner.model, eng.runner.model_path)


def engine(weights, **kw) -> Engine:
    kw.setdefault("page_size", 4)
    kw.setdefault("num_pages", 512)
    kw.setdefault("max_running_requests", 8)
    return Engine("smollm2-135m-instruct", loaded=weights[1], torch_threads=1, **kw)


def assert_idle(eng: Engine):
    s = eng.check_invariants(expect_idle=True)  # free + evictable + protected + owned == pool
    assert s.owned_pages == 0 and s.protected_pages == 0
    assert s.free_pages + s.evictable_pages == s.num_pages
    cache = eng.scheduler.cache
    if cache is not None:
        st = cache.check_invariants(num_pages=s.num_pages, free_pages=s.free_pages, expect_unlocked=True)
        assert st.min_lock_ref == 0 and st.max_lock_ref == 0
    return s


def test_second_pass_hits_the_cache_with_identical_tokens(weights):
    eng = weights[0]
    prompts = [eng.encode(SHARED + q) for q in QUESTIONS]
    first = eng.generate(prompts, GREEDY)
    assert_idle(eng)
    second = eng.generate(prompts, GREEDY)
    assert_idle(eng)
    off = engine(weights, disable_radix_cache=True).generate(prompts, GREEDY)
    for p, a, b, c in zip(prompts, first, second, off):
        assert len(a.token_ids) == GREEDY.max_tokens
        assert a.token_ids == b.token_ids == c.token_ids
        for out in (a, b):
            assert 0 <= out.cached_tokens <= len(p)
        assert c.cached_tokens == 0
        # second pass: everything but the last prompt token, page-aligned, came from the tree
        assert b.cached_tokens == (len(p) - 1) // 4 * 4 > 0
    # the four prompts share a long system prefix: in the first pass all four are admitted in the
    # same batch (nothing cached yet), so only the second pass can show hits
    assert sum(o.cached_tokens for o in second) > sum(o.cached_tokens for o in first)


@pytest.mark.parametrize("ps", [1, 4])
def test_multi_turn_reuses_committed_tokens_only(weights, ps):
    eng = engine(weights, page_size=ps, num_pages=2048 // ps)
    turn1 = eng.encode(SHARED + QUESTIONS[0])
    out1 = eng.generate(turn1, GREEDY)[0]
    assert out1.cached_tokens == 0
    assert_idle(eng)
    turn2 = turn1 + out1.token_ids + eng.encode(" And of Italy?")
    out2 = eng.generate(turn2, GREEDY)[0]
    committed = len(turn1) + len(out1.token_ids) - 1  # the last sampled token has no K/V
    assert out2.cached_tokens == committed // ps * ps
    # the same turn 2 with the cache disabled gives the same tokens
    ref = engine(weights, page_size=ps, num_pages=2048 // ps, disable_radix_cache=True)
    assert ref.generate(turn2, GREEDY)[0].token_ids == out2.token_ids
    assert_idle(eng)


def test_pool_pressure_evicts_and_keeps_outputs(weights):
    # 24 pages x 4 tokens = 96 tokens: one request fits with room, but the tree cannot keep all
    # four requests' pages at once
    small = engine(weights, num_pages=24, max_running_requests=2)
    prompts = [small.encode(f"Story {i}: " + QUESTIONS[i] * 4) for i in range(4)]
    need = [-(-(len(p) + GREEDY.max_tokens) // 4) for p in prompts]
    assert max(need) <= 24 < sum(need) - 4  # each fits alone; their committed pages do not
    outs = [small.generate(p, GREEDY)[0] for p in prompts]
    s = assert_idle(small)
    st = small.scheduler.cache.stats()
    assert st.evicted_pages_total > 0
    assert st.inserted_pages_total - st.evicted_pages_total == s.evictable_pages
    ref = engine(weights, disable_radix_cache=True).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    # and concurrent requests under pressure (preemption / waiting) end with the invariant intact
    outs2 = small.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs2] == [r.token_ids for r in ref]
    for p, o in zip(prompts, outs2):
        assert 0 <= o.cached_tokens <= len(p)
    assert_idle(small)


def test_request_larger_than_the_pool_is_rejected_before_allocating(weights):
    small = engine(weights, num_pages=4)  # 16 tokens
    before = assert_idle(small)
    too_big = small.encode(SHARED + QUESTIONS[1])  # > 16 tokens
    with pytest.raises(ResourceExhaustedError):
        small.add_request(too_big, GREEDY)
    assert not small.has_unfinished()
    assert assert_idle(small) == before
    # the engine still serves a request that fits
    ok = small.generate(small.encode("Hi there"), GREEDY)[0]
    assert len(ok.token_ids) == GREEDY.max_tokens
    assert_idle(small)
