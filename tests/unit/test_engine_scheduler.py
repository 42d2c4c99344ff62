"""Co-located engine: bad input rejected before allocation (others keep running), requests that can
never fit, pool pressure (eviction, preemption) with unchanged greedy tokens, continuous batching
through the step API, aborts, stop strings, seeded sampling; KV accounting holds after each test."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.errors import InvalidRequestError, ResourceExhaustedError
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0)
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time there was a",
           "Water boils at", "My favourite colour is"]


@pytest.fixture(scope="module")
def eng(model_dir):
    return Engine(str(model_dir), page_size=4, num_pages=512, max_running_requests=8, max_context=256)


@pytest.fixture(scope="module")
def reference(eng):
    """Greedy outputs of PROMPTS, each run alone."""
    return [eng.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


def _small(eng, **kw):
    kw = dict(page_size=4, max_running_requests=8, max_context=256, **kw)
    return Engine(str(eng.runner.model_path), loaded=(eng.runner.model, eng.runner.model_path), **kw)


BAD = [
    ("", GREEDY, "prompt"),
    ([], GREEDY, "prompt"),
    ([1, 2, 49152], GREEDY, "prompt"),
    ([1, -5], GREEDY, "prompt"),
    ("hi", SamplingParams(max_tokens=0), "max_tokens"),
    ("hi", SamplingParams(max_tokens=-1), "max_tokens"),
    ("hi", SamplingParams(max_tokens=300), "max_tokens"),  # prompt + 300 > 256-token context
    ("hi", SamplingParams(temperature=-1.0), "temperature"),
    ("hi", SamplingParams(top_p=0.0), "top_p"),
    ("hi", SamplingParams(top_p=1.01), "top_p"),
]


def test_bad_input_names_field_and_allocates_nothing(eng, reference):
    good = eng.add_request(PROMPTS[0], GREEDY)
    toks = [t for o in eng.step() for t in o.token_ids]  # the good request is running
    for prompt, params, field in BAD:  # one bad request between every two steps
        before = eng.kv_stats()
        with pytest.raises(InvalidRequestError) as ei:
            eng.add_request(prompt, params)
        assert ei.value.field == field, (prompt, params)
        assert eng.kv_stats() == before
        for o in eng.step():
            assert o.request_id == good
            toks += o.token_ids
    while eng.has_unfinished():
        toks += [t for o in eng.step() for t in o.token_ids]
    assert toks == reference[0]
    eng.check_invariants(expect_idle=True)


def test_bad_batch_queues_nothing(eng):
    with pytest.raises(InvalidRequestError, match="top_p"):
        eng.generate(["fine", "also fine"], [GREEDY, SamplingParams(top_p=2)])
    assert not eng.has_unfinished()


def test_unknown_model_name():
    with pytest.raises(InvalidRequestError) as ei:
        Engine("no-such-model-xyz")
    assert ei.value.field == "model"
    with pytest.raises(InvalidRequestError) as ei:
        Engine("no-such-shape", load_format="dummy")
    assert ei.value.field == "model"


def test_never_fits_is_resource_exhausted(eng):
    small = _small(eng, num_pages=8)  # 32 tokens of KV
    with pytest.raises(ResourceExhaustedError):
        small.add_request("hello there", SamplingParams(max_tokens=40))
    assert not small.has_unfinished()
    out = small.generate("hello there", SamplingParams(max_tokens=8, temperature=0))
    assert len(out[0].token_ids) == 8
    small.check_invariants(expect_idle=True)


def test_pool_pressure_same_tokens(eng, reference):
    # 12 pages = 48 token slots: five ~20-token requests cannot all run at once -> queueing,
    # radix eviction and preemption; tokens must not change.
    for radix in (True, False):
        small = _small(eng, num_pages=12, disable_radix_cache=not radix)
        outs = small.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == reference
        small.check_invariants(expect_idle=True)


def test_chunked_prefill_same_tokens(eng, reference):
    small = _small(eng, num_pages=256, chunked_prefill_size=3)  # every prompt spans several extend steps
    outs = small.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    small.check_invariants(expect_idle=True)


def test_preemption_happens_and_recovers(eng, reference):
    small = _small(eng, num_pages=10)
    rids = [small.add_request(p, GREEDY) for p in PROMPTS[:3]]
    toks = {r: [] for r in rids}
    preempted = 0
    while small.has_unfinished():
        for o in small.step():
            toks[o.request_id] += o.token_ids
        preempted = max(preempted, sum(r.preemptions for r in small.scheduler.running)
                        + sum(r.preemptions for r in small.scheduler.waiting))
        small.check_invariants()
    assert preempted > 0
    assert [toks[r] for r in rids] == reference[:3]
    small.check_invariants(expect_idle=True)


def test_continuous_batching_join_and_leave(eng, reference):
    a = eng.add_request(PROMPTS[1], GREEDY)
    short = eng.add_request(PROMPTS[2], SamplingParams(max_tokens=3, temperature=0))
    toks = {a: [], short: []}
    steps = 0
    late = None
    while eng.has_unfinished():
        outs = eng.step()
        steps += 1
        for o in outs:
            toks[o.request_id] += o.token_ids
            if o.request_id == short and o.finished:
                assert o.finish_reason == "length" and o.completion_tokens == 3
        if steps == 5:  # join a running batch
            late = eng.add_request(PROMPTS[3], GREEDY)
            toks[late] = []
            assert eng.kv_stats().running == 1  # `short` already left
    assert toks[a] == reference[1]
    assert toks[short] == reference[2][:3]
    assert toks[late] == reference[3]
    eng.check_invariants(expect_idle=True)


def test_abort(eng):
    rid = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=50, temperature=0))
    eng.step()
    eng.step()
    out = eng.abort(rid)
    assert out.finished and out.finish_reason == "abort"
    assert eng.abort(rid) is None
    assert not eng.has_unfinished()
    eng.check_invariants(expect_idle=True)


def test_stop_strings_and_ids(eng, reference):
    full = eng.generate(PROMPTS[0], GREEDY)[0]
    text = full.text
    cut = len(text) // 2
    stop = text[cut:cut + 3]
    first = text.find(stop)
    o = eng.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, stop=[stop]))[0]
    assert o.text == text[:first] and o.finish_reason == "stop" and o.stop_str == stop
    stop_id = reference[0][4]
    o = eng.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id]))[0]
    k = reference[0].index(stop_id)
    assert o.token_ids == reference[0][:k + 1] and o.finish_reason == "stop"
    assert o.text == eng.tokenizer.decode(reference[0][:k])
    eng.check_invariants(expect_idle=True)


def test_seeded_sampling_reproducible_in_batch(eng):
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=1234)
    alone = eng.generate(PROMPTS[2], p)[0].token_ids
    batch = eng.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]],
                         [SamplingParams(max_tokens=10, temperature=0.9, seed=5), p, GREEDY])
    assert batch[1].token_ids == alone
    other = eng.generate(PROMPTS[2], SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=99))[0]
    assert other.token_ids != alone
    eng.check_invariants(expect_idle=True)


def test_logprobs_and_stream(eng, reference):
    outs = list(eng.stream(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)))
    toks = [t for o in outs for t in o.token_ids]
    assert toks == reference[0]
    lps = [lp for o in outs for lp in o.logprobs]
    tops = [tp for o in outs for tp in o.top_logprobs]
    assert len(lps) == 12 and all(lp <= 0 for lp in lps)
    assert all(tp[0][0] == t and tp[0][1] == pytest.approx(lp) for tp, t, lp in zip(tops, toks, lps))
    assert outs[-1].finished and outs[-1].completion_tokens == 12
    assert "".join(o.text for o in outs) == eng.tokenizer.decode(toks)


@pytest.mark.parametrize("limit", [2, 3])
def test_max_retractions_pins_a_request(eng, limit):
    """Two requests that cannot both finish in 10 pages, the newer one already preempted twice:
    with max_retractions=2 it is pinned and the older one is preempted instead; with 3 the newer
    one is still the victim. Tokens equal each request run alone either way."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = [eng.generate(p, params)[0].token_ids for p in PROMPTS[:2]]
    small = _small(eng, num_pages=10, max_retractions=limit)
    rids = [small.add_request(p, params) for p in PROMPTS[:2]]
    reqs = list(small.scheduler.waiting)
    reqs[1].preemptions = 2
    toks = {r: [] for r in rids}
    while small.has_unfinished():
        for o in small.step():
            toks[o.request_id] += o.token_ids
        small.check_invariants()
    assert [r.preemptions for r in reqs] == ([1, 2] if limit == 2 else [0, 3])
    assert [toks[r] for r in rids] == ref
    small.check_invariants(expect_idle=True)
    with pytest.raises(ValueError, match="max_retractions"):
        _small(eng, num_pages=10, max_retractions=-1)
