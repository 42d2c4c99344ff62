"""The tensor-parallel shard plan (engine/distributed/shard.py): every q head on exactly one rank,
each rank's q heads read only its own kv heads with a uniform GQA mapping, uneven kv splits when
the rank count does not divide them, kv heads replicated when there are fewer than ranks, and a
split that cannot work refused naming ``tp``."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import ModelConfig
from engine.distributed.shard import even_split, plan_shard
from engine.distributed.tp_model import param_slices
from engine.errors import InvalidRequestError

SMOLLM2 = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                      rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True,
                      attention_bias=False, qk_norm=False, eos_token_ids=(2,), bos_token_id=1, dtype=None)


def test_smollm2_tp2_is_an_uneven_split_by_kv_group():
    r0, r1 = (plan_shard(SMOLLM2, r, 2) for r in range(2))
    assert (r0.kv_heads, r0.q_heads) == ((0, 2), (0, 6))
    assert (r1.kv_heads, r1.q_heads) == ((2, 3), (6, 9))
    assert r0.intermediate == (0, 768) and r1.intermediate == (768, 1536)
    assert r0.vocab == (0, 24576) and r1.vocab == (24576, 49152)


def test_smollm2_tp3_one_kv_head_per_rank():
    plans = [plan_shard(SMOLLM2, r, 3) for r in range(3)]
    assert [p.kv_heads for p in plans] == [(0, 1), (1, 2), (2, 3)]
    assert [p.q_heads for p in plans] == [(0, 3), (3, 6), (6, 9)]


@pytest.mark.parametrize("h,kv,tp", [(9, 3, 1), (9, 3, 2), (9, 3, 3), (9, 3, 6), (9, 3, 9), (32, 8, 3),
                                     (32, 8, 8), (32, 8, 16), (14, 2, 4), (12, 12, 5), (28, 4, 8)])
def test_every_q_head_once_and_reading_its_own_kv_heads(h, kv, tp):
    cfg = dataclasses.replace(SMOLLM2, num_heads=h, num_kv_heads=kv, vocab_size=1001)
    plans = [plan_shard(cfg, r, tp) for r in range(tp)]
    covered = [q for p in plans for q in range(*p.q_heads)]
    assert covered == list(range(h))
    group = h // kv
    for p in plans:
        assert p.num_q_heads >= 1 and p.num_q_heads % p.num_kv_heads == 0  # uniform local GQA
        local_group = p.num_q_heads // p.num_kv_heads
        for j, q in enumerate(range(*p.q_heads)):
            assert q // group == p.kv_heads[0] + j // local_group
    if kv >= tp:  # disjoint kv heads, sizes within one
        assert [k for p in plans for k in range(*p.kv_heads)] == list(range(kv))
    vocab = [v for p in plans for v in range(*p.vocab)]
    assert vocab[:1001] == list(range(1001)) and all(p.vocab_per_rank == plans[0].vocab_per_rank for p in plans)


@pytest.mark.parametrize("tp", [4, 5, 10, 0])
def test_splits_that_cannot_work_name_tp(tp):
    with pytest.raises(InvalidRequestError) as e:
        plan_shard(SMOLLM2, 0, tp)
    assert e.value.field == "tp"


def test_even_split_sizes_differ_by_at_most_one():
    for n in range(1, 20):
        for parts in range(1, n + 1):
            ranges = [even_split(n, parts, i) for i in range(parts)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1


def test_param_slices_follow_the_heads():
    p = plan_shard(SMOLLM2, 1, 2)
    s = param_slices(SMOLLM2, p)
    assert s["model.layers.0.self_attn.q_proj.weight"] == (0, 6 * 64, 9 * 64)
    assert s["model.layers.0.self_attn.k_proj.weight"] == (0, 2 * 64, 3 * 64)
    assert s["model.layers.29.self_attn.o_proj.weight"] == (1, 6 * 64, 9 * 64)
    assert s["model.layers.3.mlp.down_proj.weight"] == (1, 768, 1536)
    assert "model.layers.0.input_layernorm.weight" not in s  # replicated
