"""D's unblock on a follower rank (pd_common/head_blocks.py, pd_common/tp_rank.py): a real TP=2
runner (rank 1 a ``pd_common.tp_rank`` process with its own transfer engine) over a tiny 4-kv-head
model, so rank 1 holds heads [2, 4). Its delta pages are made head-blocked at cut 3 exactly as P's
writes leave them (read over UCX from rank 1's registered pool, blocked, written back), then rank 0's
``HeadUnblocker`` sends the unblock on the command pipe, with no reply: the next message on that
pipe (an accounting query, as any later forward would) is handled after it, and rank 1's pages are
token-major again, byte for byte. (The default model's 3 kv heads never cut a follower's range.)"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.config import EngineConfig
from engine.distributed.group import FollowerSpec
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.model_runner import ModelRunner
from pd_common.head_blocks import HeadUnblocker
from pd_common.rank_accounting import disagreements, rank_accounting
from pd_common.rank_collection import collect_ranks
from pd_common.tp_rank import AgentConfig
from transfer_svc import Op, State, TransferEngine

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": True, "eos_token_id": 2, "bos_token_id": 1}
PS = 4


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    path = tmp_path_factory.mktemp("unblock")
    (path / "config.json").write_text(json.dumps(TINY))
    cfg = EngineConfig(model=str(path), load_format="dummy", page_size=PS, num_pages=32, max_running_requests=4,
                       max_context=64, torch_threads=1, tp_size=2)
    spec = FollowerSpec("pd_common.tp_rank", json.dumps(dataclasses.asdict(AgentConfig("unblock-test", "sm", 10.0))))
    runner = ModelRunner(cfg, follower=spec)
    try:
        yield runner
    finally:
        runner.close()


def test_a_follower_unblocks_its_pages_in_pipe_order(tp2):
    ranks = collect_ranks(tp2)
    assert [(r.head_start, r.head_end) for r in ranks.regions] == [(0, 2), (2, 4)]
    with torch.inference_mode():
        tokens = list(range(5, 5 + 3 * PS))
        row, slots = tp2.req_to_token_pool.alloc(), tp2.allocator.alloc_slots(0, len(tokens), None)
        tp2.req_to_token_pool.write(row, 0, slots)
        tp2.forward(ForwardBatch.build(ForwardMode.EXTEND, [row], [0], [tokens], slots))
    pages = sorted({int(s) // PS for s in slots.tolist()})
    page_elems = TINY["num_hidden_layers"] * 2 * PS * 2 * TINY["head_dim"]  # rank 1: 2 heads
    page_bytes = page_elems * 4
    base = ranks.regions[1].base
    local = torch.zeros(len(pages), page_elems)
    eng = TransferEngine("unblock-test-reader", transports="sm", timeout_s=30.0)
    try:
        eng.register_memory(local.data_ptr(), local.numel() * 4)
        seg = eng.open_segment(ranks.descriptors[0])

        def move(op):
            descs = [(local.data_ptr() + i * page_bytes, base + p * page_bytes, page_bytes) for i, p in enumerate(pages)]
            assert eng.wait(eng.submit(seg, descs, op)).state is State.COMPLETED

        move(Op.READ)
        want = local.clone().view(len(pages), TINY["num_hidden_layers"], 2, PS, 2, TINY["head_dim"])
        assert want.abs().sum() > 0  # the forward wrote rank 1's KV
        # as P TP=3's writes leave D rank 1's pages (heads [2, 3) then [3, 4), each contiguous)
        local.copy_(torch.cat([want[..., 0:1, :].reshape(len(pages), -1),
                               want[..., 1:2, :].reshape(len(pages), -1)], dim=1))
        move(Op.WRITE)
        move(Op.READ)
        assert not torch.equal(local.view_as(want), want)  # blocked now
        rank0 = tp2.kv_pool.region[pages].clone()
        assert HeadUnblocker.for_runner(tp2).unblock(pages, [0, 2, 3, 4]) == ""
        assert disagreements(rank_accounting(tp2)) == []  # handled after the unblock, same pipe
        move(Op.READ)
        assert torch.equal(local.view_as(want), want)  # token-major again, exactly
        assert torch.equal(tp2.kv_pool.region[pages], rank0)  # rank 0's heads were never cut
    finally:
        eng.close()
        tp2.allocator.free_slots(slots)
        tp2.req_to_token_pool.free(row)
