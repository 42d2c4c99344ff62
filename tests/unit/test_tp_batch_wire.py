"""A ForwardBatch through the tensor-parallel batch message (engine/distributed/batch_wire.py):
every field, the logit index, rank 0's CUDA-graph decision and each request's req_to_token row
[0, seq_len) arrive as sent; a follower (engine/distributed/follower.py ``follow_step``) takes the
branch rank 0 took: the graph of the sent bucket, or the eager model of a real CPU runner."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import EngineConfig
from engine.distributed.batch_wire import WireBatch, pack_batch, unpack_batch
from engine.distributed.follower import follow_step
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.model_runner import ModelRunner

FIELDS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "prefix_lens", "extend_lens", "out_cache_loc",
          "seq_lens_cpu", "extend_lens_cpu")


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
@pytest.mark.parametrize("with_index", [False, True])
def test_round_trip(mode, with_index):
    src = torch.arange(6 * 40, dtype=torch.int64).reshape(6, 40) * 7
    if mode is ForwardMode.EXTEND:
        batch = ForwardBatch.build(mode, [4, 1], [3, 0], [[5, 6], [7, 8, 9]], torch.tensor([31, 32, 40, 41, 42]))
    else:
        batch = ForwardBatch.decode([2, 5, 0], [10, 0, 39], [1, 2, 3], src)
    index = torch.tensor([0, 2]) if with_index else None
    dst = torch.full_like(src, -1)
    step = unpack_batch(pack_batch(batch, index, src), dst)
    got, got_index = step.batch, step.logit_index
    assert got.mode is mode and step.graph_bucket == 0
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(batch, f)), f
    assert (got_index is None) == (index is None) and (index is None or torch.equal(got_index, index))
    for row, s in zip(batch.req_pool_indices.tolist(), batch.seq_lens.tolist()):
        assert torch.equal(dst[row, :s], src[row, :s]) and (dst[row, s:] == -1).all()
    untouched = set(range(6)) - set(batch.req_pool_indices.tolist())
    assert all((dst[r] == -1).all() for r in untouched)


def test_a_short_message_is_refused():
    src = torch.zeros(2, 8, dtype=torch.int64)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [0], [0], [[1, 2]], torch.tensor([0, 1]))
    msg = pack_batch(batch, None, src)
    with pytest.raises(ValueError):
        unpack_batch(torch.cat([msg, torch.zeros(1, dtype=torch.int64)]), src.clone())


def _decode(src: torch.Tensor) -> ForwardBatch:
    return ForwardBatch.decode([2, 5, 0], [10, 0, 39], [1, 2, 3], src)


def test_the_graph_decision_travels_with_the_batch():
    src = torch.arange(6 * 40, dtype=torch.int64).reshape(6, 40)
    step = unpack_batch(pack_batch(_decode(src), None, src, graph_bucket=4), torch.zeros_like(src))
    assert step.graph_bucket == 4 and step.logit_index is None and step.batch.batch_size == 3


@pytest.mark.parametrize("case", ["extend", "logit_index", "too_small"])
def test_a_graph_decision_that_cannot_hold_is_refused(case):
    src = torch.zeros(6, 40, dtype=torch.int64)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [0], [0], [[1, 2]], torch.tensor([0, 1])) \
        if case == "extend" else _decode(src)
    index = torch.tensor([0]) if case == "logit_index" else None
    with pytest.raises(ValueError, match="graph bucket"):
        pack_batch(batch, index, src, graph_bucket=2 if case == "too_small" else 4)


class _Graphs:
    """Records replays (a CUDA graph cannot be captured on CPU); what follow_step's graph branch calls."""

    buckets = [1, 2, 4, 8]

    def __init__(self):
        self.replayed = []

    def replay(self, batch, bucket):
        self.replayed.append((batch.batch_size, bucket))
        return torch.empty(batch.batch_size, 0)


TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": True,
        "eos_token_id": 2, "bos_token_id": 1}


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    (d / "config.json").write_text(json.dumps(TINY))
    return ModelRunner(EngineConfig(model=str(d), load_format="dummy", page_size=4, num_pages=16,
                                    max_running_requests=4, max_context=64, torch_threads=1))


def test_a_follower_takes_rank0s_branch(runner):
    r2t = runner.req_to_token_pool.req_to_token
    rows = [runner.req_to_token_pool.alloc() for _ in range(3)]
    slots = runner.allocator.alloc_slots(0, 3 * 8, None)
    for i, row in enumerate(rows):
        runner.req_to_token_pool.write(row, 0, slots[i * 8:(i + 1) * 8])
    batch = ForwardBatch.decode(rows, [7, 7, 7], [5, 6, 7], r2t)
    want = runner.model(batch, runner.backend)  # rank 0's eager forward of the same batch
    eager = unpack_batch(pack_batch(batch, None, r2t), r2t.clone())
    assert torch.equal(follow_step(runner, eager), want)
    graphed = unpack_batch(pack_batch(batch, None, r2t, graph_bucket=4), r2t.clone())
    with pytest.raises(RuntimeError, match="bucket 4; this rank captured none"):
        follow_step(runner, graphed)  # a rank without graphs never runs eagerly behind rank 0's replay
    runner.graph_runner = graphs = _Graphs()
    try:
        follow_step(runner, graphed)
        assert graphs.replayed == [(3, 4)]  # the bucket rank 0 chose, not one of its own
        with pytest.raises(RuntimeError, match="bucket 16; this rank captured"):
            follow_step(runner, WireBatch(graphed.batch, None, 16))
        assert torch.equal(follow_step(runner, eager), want)  # eager stays eager with graphs captured
        assert graphs.replayed == [(3, 4)]
    finally:
        runner.graph_runner = None
