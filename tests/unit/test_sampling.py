"""Sampler knobs against hand-computed distributions on small logits; seeded reproducibility;
SamplingParams validation naming the field."""

from __future__ import annotations

import math

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampler import make_generator, processed_probs, sample
from engine.sampling_params import SamplingParams, validate_prompt_ids

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])


def softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def close(got, want):
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), atol=1e-6, rtol=0)


def test_temperature():
    close(processed_probs(LOGITS, SamplingParams(temperature=0.5)), softmax([x / 0.5 for x in LOGITS.tolist()]))
    close(processed_probs(LOGITS, SamplingParams(temperature=1.0)), softmax(LOGITS.tolist()))


def test_greedy_is_one_hot_argmax():
    close(processed_probs(LOGITS, SamplingParams(temperature=0)), [1, 0, 0, 0, 0])
    out = sample(torch.stack([LOGITS, LOGITS.flip(0)]), [SamplingParams(temperature=0)] * 2, [None, None], [[], []], [[], []])
    assert out.token_ids == [0, 4]


def test_top_k():
    p = softmax([2.0, 1.0])
    close(processed_probs(LOGITS, SamplingParams(top_k=2)), p + [0, 0, 0])


def test_top_p():
    full = softmax(LOGITS.tolist())  # ~[0.53, 0.20, 0.12, 0.07, 0.03]
    # top_p=0.7: 0.53 < 0.7, 0.53+0.20 >= 0.7 -> keep two
    two = [full[0] / (full[0] + full[1]), full[1] / (full[0] + full[1]), 0, 0, 0]
    close(processed_probs(LOGITS, SamplingParams(top_p=0.7)), two)
    # top_p tiny keeps only the top token
    close(processed_probs(LOGITS, SamplingParams(top_p=0.01)), [1, 0, 0, 0, 0])


def test_min_p():
    full = softmax(LOGITS.tolist())
    # min_p=0.2: keep p >= 0.2 * p_max = 0.106 -> tokens 0, 1, 2
    keep = full[:3]
    close(processed_probs(LOGITS, SamplingParams(min_p=0.2)), [v / sum(keep) for v in keep] + [0, 0])


def test_repetition_penalty():
    # HF: positive logits divided, negative multiplied, for tokens in prompt or output
    p = SamplingParams(repetition_penalty=2.0)
    want = softmax([2.0 / 2, 1.0, 0.5, 0.0, -1.0 * 2])
    close(processed_probs(LOGITS, p, prompt_ids=[0], output_ids=[4, 4]), want)


def test_frequency_and_presence_penalties():
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # output has token 1 twice, token 3 once; prompt tokens do not count
    want = softmax([2.0, 1.0 - 2 * 0.5 - 0.25, 0.5, 0.0 - 0.5 - 0.25, -1.0])
    close(processed_probs(LOGITS, p, prompt_ids=[0, 0], output_ids=[1, 3, 1]), want)


def test_penalties_then_greedy():
    p = SamplingParams(temperature=0, presence_penalty=2.0)
    out = sample(LOGITS[None], [p], [None], [[]], [[0]])
    assert out.token_ids == [1]  # 2.0 - 2.0 = 0.0 < 1.0


def test_sampling_follows_distribution():
    p = SamplingParams(temperature=0.7, top_k=4)
    want = processed_probs(LOGITS, p)
    g = make_generator(123)
    n = 4000
    counts = torch.zeros(5)
    for _ in range(n):
        counts[sample(LOGITS[None], [p], [g], [[]], [[]]).token_ids[0]] += 1
    assert counts[4] == 0  # cut by top_k
    torch.testing.assert_close(counts / n, want, atol=0.03, rtol=0)


def test_seeded_sampling_reproducible():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=7)

    def run(seed):
        gens = [make_generator(seed + i) for i in range(3)]
        return [sample(logits, [p] * 3, gens, [[]] * 3, [[]] * 3).token_ids for _ in range(20)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_logprobs_and_top_logprobs():
    p = SamplingParams(temperature=0, logprobs=True, top_logprobs=2)
    out = sample(LOGITS[None], [p], [None], [[]], [[]])
    lsm = torch.log_softmax(LOGITS, -1)
    assert out.logprobs[0] == pytest.approx(lsm[0].item())
    assert [t for t, _ in out.top_logprobs[0]] == [0, 1]
    assert out.top_logprobs[0][1][1] == pytest.approx(lsm[1].item())
    assert sample(LOGITS[None], [SamplingParams(temperature=0)], [None], [[]], [[]]).logprobs == [None]


@pytest.mark.parametrize("field,kw", [
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=float("nan"))),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-2)),
    ("min_p", dict(min_p=1.1)),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-3)),
    ("max_tokens", dict(max_tokens=95)),  # 10 + 95 > 100
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("frequency_penalty", dict(frequency_penalty=2.5)),
    ("presence_penalty", dict(presence_penalty=-3.0)),
    ("seed", dict(seed=-1)),
    ("stop", dict(stop=[""])),
    ("stop_token_ids", dict(stop_token_ids=[50])),
    ("top_logprobs", dict(top_logprobs=21)),
])
def test_validate_names_field(field, kw):
    with pytest.raises(InvalidRequestError) as ei:
        SamplingParams(**kw).validate(vocab_size=50, max_context=100, prompt_len=10)
    assert ei.value.field == field and field in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_validate_ok_and_prompt():
    SamplingParams(max_tokens=90, top_p=1.0, top_k=0, stop="x").validate(50, 100, 10)
    with pytest.raises(InvalidRequestError, match="prompt"):
        SamplingParams().validate(50, 100, 0)
    with pytest.raises(InvalidRequestError) as ei:
        validate_prompt_ids([1, 50], 50)
    assert ei.value.field == "prompt"
    with pytest.raises(InvalidRequestError):
        validate_prompt_ids([-1], 50)
    validate_prompt_ids([0, 49], 50)
