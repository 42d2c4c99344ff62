"""Seeded workloads: exact prompt lengths with the real SmolLM2 tokenizer, reproducibility, shared prefixes."""

import pytest

from bench import gsm8k, workloads
from engine.model_store import ModelNotFoundError, resolve_model


@pytest.fixture(scope="module")
def words():
    try:
        path = resolve_model("smollm2-135m-instruct")
    except ModelNotFoundError as e:
        pytest.skip(f"default model not pulled: {e}")
    return workloads.WordSampler(path)


def test_word_prompts_round_trip_to_the_same_ids(words):
    import random

    rng = random.Random(7)
    for n in (1, 17, 300):
        ids = words.ids(rng, n)
        text = words.text(ids)
        assert words.encode(text) == ids
        assert len(words.encode(text)) == n


def test_random_lengths_are_seeded_and_within_the_range(words):
    a = workloads.random_lengths(words, 20, input_len=100, output_len=10, range_ratio=0.5, seed=3)
    b = workloads.random_lengths(words, 20, input_len=100, output_len=10, range_ratio=0.5, seed=3)
    c = workloads.random_lengths(words, 20, input_len=100, output_len=10, range_ratio=0.5, seed=4)
    assert [s.requests[0].prompt_ids for s in a] == [s.requests[0].prompt_ids for s in b]
    assert [s.requests[0].prompt_ids for s in a] != [s.requests[0].prompt_ids for s in c]
    for s in a:
        (r,) = s.requests
        assert 50 <= len(r.prompt_ids) <= 150 and 5 <= r.max_tokens <= 15
        assert words.encode(r.prompt) == r.prompt_ids and r.ignore_eos
    assert len({len(s.requests[0].prompt_ids) for s in a}) > 1
    with pytest.raises(ValueError, match="range_ratio"):
        workloads.random_lengths(words, 1, 10, 10, 1.0, 0)


def test_shared_prefix_groups_share_exactly_the_prefix(words):
    sessions = workloads.shared_prefix(words, num=12, groups=3, prefix_len=40, suffix_len=8, output_len=4, seed=1)
    assert len(sessions) == 12
    by_group: dict[int, list[list[int]]] = {}
    for s in sessions:
        r = s.requests[0]
        assert len(r.prompt_ids) == 48 and words.encode(r.prompt) == r.prompt_ids
        by_group.setdefault(r.group, []).append(r.prompt_ids)
    assert sorted(by_group) == [0, 1, 2] and all(len(v) == 4 for v in by_group.values())
    prefixes = set()
    for ids in by_group.values():
        assert len({tuple(p[:40]) for p in ids}) == 1        # one prefix per group
        assert len({tuple(p[40:]) for p in ids}) == len(ids)  # unique suffixes
        prefixes.add(tuple(ids[0][:40]))
    assert len(prefixes) == 3
    assert [s.requests[0].group for s in sessions] != [i % 3 for i in range(12)]  # shuffled


def test_multi_turn_sessions_hold_one_user_message_per_turn(words):
    sessions = workloads.multi_turn(words, num_requests=10, turns=4, user_len=12, output_len=5, seed=0)
    assert len(sessions) == 3 and all(s.chat for s in sessions)
    for s in sessions:
        assert [r.turn for r in s.requests] == [0, 1, 2, 3]
        for r in s.requests:
            assert len(r.messages) == 1 and r.messages[0]["role"] == "user"
            assert len(words.encode(" " + r.messages[0]["content"])) == 12


def test_gsm8k_prompts_share_the_few_shot_prefix():
    try:
        train = gsm8k.load("train")
    except gsm8k.DataNotFoundError as e:
        pytest.skip(f"GSM8K data not present: {e}")
    sessions = workloads.gsm8k_prompts(5, num_shots=3, output_len=32, seed=0)
    prefix = gsm8k.few_shot_prefix(train, 3)
    assert prefix.count("Question:") == 3 and prefix.count("####") == 3
    for s in sessions:
        r = s.requests[0]
        assert r.prompt.startswith(prefix) and r.prompt.endswith("\nAnswer:")
        assert r.prompt.count("Question:") == 4 and r.stop == gsm8k.STOP and not r.ignore_eos
    assert [s.requests[0].tag for s in sessions] == [s.requests[0].tag for s in workloads.gsm8k_prompts(5, 3, 32, 0)]


def test_advertise_max_tokens_sends_n_and_stops_at_the_drawn_length(words):
    import argparse

    from bench import serve

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--workload", "random", "--num-requests", "6", "--input-len", "32",
                         "--output-len", "40", "--range-ratio", "0.5", "--advertise-max-tokens", "3000"])
    drawn = [r.max_tokens for s in serve._workload_sessions(args, 6, 0) for r in s.requests]
    reqs = [r for s in serve.build_sessions(args, 6, 0) for r in s.requests]
    assert [r.stop_after for r in reqs] == drawn and len(set(drawn)) > 1
    assert {r.max_tokens for r in reqs} == {3000}
    args.advertise_max_tokens = None
    assert all(r.stop_after is None for s in serve.build_sessions(args, 6, 0) for r in s.requests)
    with pytest.raises(SystemExit, match="--advertise-max-tokens"):
        serve._validate(p.parse_args(["--advertise-max-tokens", "0"]))
