"""Greedy tokens of the co-located engine == transformers ``generate`` on the same fp32 weights,
for 10 prompts in one continuously batched run (lengths 1, page-aligned, non-aligned, ~600 tokens;
plain and chat-templated); identical again on a second pass served from the radix cache, and with
the radix cache disabled.
"""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.sampling_params import SamplingParams

MAX_TOKENS = 16
PAGE = 16

LONG = (
    "The history of astronomy spans thousands of years. Early civilizations tracked the motions of "
    "the Sun, the Moon and the planets to build calendars, predict eclipses and plan harvests. "
    "Babylonian scribes recorded planetary positions on clay tablets; Greek philosophers proposed "
    "geometric models of the heavens; Islamic scholars refined instruments such as the astrolabe. "
    "In the sixteenth century Copernicus placed the Sun at the centre, Kepler found elliptical "
    "orbits, and Galileo turned a telescope to the sky and saw the moons of Jupiter. Newton's laws "
    "of motion and gravitation then explained why the planets move as they do. "
)


@pytest.fixture(scope="module")
def setup(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = lambda s: tok(s)["input_ids"]  # noqa: E731
    chat = lambda m: tok(tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False,  # noqa: E731
                                                 add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    long_ids = ids(LONG * 8)[:600]
    prompts = [
        ids("Hello")[:1],  # length 1
        ids("The capital of France is Paris, and the capital of Germany is Berlin. The capital")[:PAGE],
        ids("Once upon a time, in a land far away, there lived a king who had three daughters. "
            "The youngest daughter was the most beautiful of them all, and the king loved her")[:2 * PAGE],  # page-aligned
        ids("def fibonacci(n):"),  # non-aligned
        ids("1, 2, 3, 4, 5,"),
        long_ids,  # ~600 tokens
        chat("What is the capital of France?"),
        chat("Write a haiku about the sea."),
        ids("The quick brown fox"),
        chat("List three prime numbers."),
    ]
    assert len(prompts[0]) == 1 and len(prompts[1]) == PAGE and len(prompts[2]) == 2 * PAGE
    assert len(prompts[3]) % PAGE and len(long_ids) == 600
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for p in prompts:
            out = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=MAX_TOKENS, do_sample=False)
            want.append(out[0, len(p):].tolist())
    del ref
    eng = Engine(str(model_dir), page_size=PAGE, num_pages=256, max_running_requests=16, max_context=2048)
    return prompts, want, eng


def test_greedy_batch_matches_transformers(setup):
    prompts, want, eng = setup
    outs = eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    for i, (o, w) in enumerate(zip(outs, want)):
        assert o.token_ids == w, f"prompt {i} (len {len(prompts[i])}): {o.token_ids} != {w}"
        assert o.cached_tokens == 0
    eng.check_invariants(expect_idle=True)
    assert eng.kv_stats().evictable_pages > 0  # finished requests left their pages in the radix cache

    # second pass (page-aligned, long and chat prompts): prefixes come from the radix cache, same tokens
    sub = [1, 2, 5, 6, 7]
    again = eng.generate([prompts[i] for i in sub], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert [o.token_ids for o in again] == [want[i] for i in sub]
    cached = [o.cached_tokens for o in again]
    assert cached[2] == 592  # 600-token prompt: all full pages of prompt[:-1]
    assert cached[0] == 0 and cached[1] == PAGE  # a 16-token prompt keeps its one page to compute
    assert all(0 < c <= len(prompts[i]) - 1 for c, i in zip(cached[1:], sub[1:]))
    eng.check_invariants(expect_idle=True)


def test_radix_disabled_same_tokens(setup):
    prompts, want, eng = setup
    off = Engine(str(eng.runner.model_path), page_size=4, num_pages=1024, max_running_requests=4,
                 max_context=2048, disable_radix_cache=True, loaded=(eng.runner.model, eng.runner.model_path))
    # max_running_requests=4 < 10 prompts: requests join the running batch as others finish
    outs = off.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert [o.token_ids for o in outs] == want
    assert all(o.cached_tokens == 0 for o in outs)
    s = off.check_invariants(expect_idle=True)
    assert s.free_pages == s.num_pages
