"""Accounting on every tensor-parallel rank (pd_common/rank_accounting.py): a real PD rank process
(``pd_common.tp_rank``: its follower loop, its UCX transfer engine) under a TP=2 ``ModelRunner`` of
a tiny random model (gloo, one torch thread), queried over the group's command channel.

* after forwards, rank 1's pool, forward count and page-table rows agree with rank 0's;
* a page-table row of rank 0 that differs from what rank 1 was sent (the drift a lost or wrong
  row write would leave) is named, and so is a forward rank 1 did not run;
* one rank: rank 0's entry alone.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.config import EngineConfig
from engine.distributed.group import FollowerSpec
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.model_runner import ModelRunner
from pd_common.rank_accounting import disagreements, rank_accounting
from pd_common.tp_rank import AgentConfig

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": True, "eos_token_id": 2, "bos_token_id": 1}


def _runner(tmp_path, tp: int) -> ModelRunner:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    cfg = EngineConfig(model=str(tmp_path), load_format="dummy", page_size=4, num_pages=32, max_running_requests=4,
                       max_context=64, torch_threads=1, tp_size=tp)
    spec = FollowerSpec("pd_common.tp_rank", json.dumps(dataclasses.asdict(AgentConfig("acct-test", None, 10.0))))
    return ModelRunner(cfg, follower=spec if tp > 1 else None)


def _extend(runner, tokens: list[int]) -> int:
    row, slots = runner.req_to_token_pool.alloc(), runner.allocator.alloc_slots(0, len(tokens), None)
    runner.req_to_token_pool.write(row, 0, slots)
    runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [row], [0], [tokens], slots))
    return row


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    runner = _runner(tmp_path_factory.mktemp("acct"), 2)
    try:
        yield runner
    finally:
        runner.close()


def test_every_rank_agrees_after_forwards(tp2):
    with torch.inference_mode():
        _extend(tp2, [5, 6, 7, 8, 9, 10])
        _extend(tp2, [11, 12, 13])
    ranks = rank_accounting(tp2)
    assert [r.rank for r in ranks] == [0, 1]
    assert ranks[0].pool_pages == tp2.kv_pool.num_pages == ranks[1].pool_pages
    assert ranks[0].batches == ranks[1].batches == tp2.tp.batches >= 2
    assert ranks[1].table_rows == 1 and ranks[1].table_crc == ranks[0].table_crc
    assert disagreements(ranks) == []


def test_a_drifted_page_table_or_a_missed_forward_is_named(tp2):
    with torch.inference_mode():
        row = _extend(tp2, [20, 21, 22, 23, 24])
    r2t = tp2.req_to_token_pool.req_to_token
    was = int(r2t[row, 2])
    r2t[row, 2] = was + 1  # rank 0's row no longer what rank 1 holds
    try:
        bad = disagreements(rank_accounting(tp2))
    finally:
        r2t[row, 2] = was
    assert len(bad) == 1 and bad[0].startswith("rank 1 table_crc"), bad
    tp2.tp.batches += 1  # rank 0 counts a forward rank 1 never ran
    try:
        bad = disagreements(rank_accounting(tp2))
    finally:
        tp2.tp.batches -= 1
    assert len(bad) == 1 and bad[0].startswith("rank 1 batches"), bad
    assert disagreements(rank_accounting(tp2)) == []


def test_one_rank_is_rank_zeros_entry_alone(tmp_path):
    runner = _runner(tmp_path, 1)
    ranks = rank_accounting(runner)
    assert len(ranks) == 1 and ranks[0].rank == 0 and ranks[0].pool_pages == runner.kv_pool.num_pages
    assert disagreements(ranks) == []
