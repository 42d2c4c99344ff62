"""CUDA graphs under tensor parallelism (engine/cuda_graph_runner.py, engine/distributed/): TP=2 on
two GPUs (NCCL) with CUDA graphs and fused ops, SmolLM2-135M in bfloat16. Every rank captures the
same buckets at start-up (each logs ``cuda_graphs=on``); a decode step's bucket travels in the
batch broadcast and the follower replays it. Greedy tokens of a continuously batched run (decode
batches of 4 requests: bucket 4) equal the TP=1 eager engine's, and a decode forward of 3 requests
(bucket 4, one entry padded into the scratch page) has TP=1's argmax and logits within bf16
tolerance of TP=1's.

Needs two CUDA devices (skipped otherwise); the CPU half of the design (the decision on the wire,
the follower's branch) is tests/unit/test_tp_batch_wire.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

from engine.engine import Engine
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason=f"needs 2 CUDA devices for TP=2 over NCCL "
                                        f"(this host has {torch.cuda.device_count()})")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,",
           "Once upon a time, in a land far away, there lived a king who had three daughters. The youngest"]
MAX_TOKENS = 12


def _engine(model_dir, tp: int, graphs: bool) -> Engine:
    return Engine(str(model_dir), device="cuda", dtype="bfloat16", page_size=16, num_pages=128,
                  max_running_requests=8, max_context=512, cuda_graph=graphs, cuda_graph_max_bs=8,
                  torch_threads=1, tp_size=tp)


def _decode_logits(engine: Engine, ids: list[list[int]]) -> torch.Tensor:
    """Extend each prompt, then one decode step of all of them (3 requests: bucket 4, one pad)."""
    r = engine.runner
    rows, slots, lens = [], [], []
    for p in ids:
        row, s = r.req_to_token_pool.alloc(), r.allocator.alloc_slots(0, len(p) + 1, None)
        r.req_to_token_pool.write(row, 0, s)
        r.forward(ForwardBatch.build(ForwardMode.EXTEND, [row], [0], [p], s[: len(p)], "cuda"))
        rows.append(row)
        slots.append(s)
        lens.append(len(p))
    batch = ForwardBatch.build(ForwardMode.DECODE, rows, lens, [[p[-1]] for p in ids],
                               torch.stack([s[n] for s, n in zip(slots, lens)]), "cuda")
    out = r.forward(batch).float().clone()
    for row, s in zip(rows, slots):
        r.allocator.free_slots(s)
        r.req_to_token_pool.free(row)
    return out


def test_tp2_with_cuda_graphs_equals_tp1_eager(model_dir, capfd, caplog):
    from transformers import AutoTokenizer

    caplog.set_level(logging.INFO, logger="halfmoon.engine.tp")

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    eager = _engine(model_dir, 1, graphs=False)
    try:
        assert eager.runner.graph_runner is None
        want = [o.token_ids for o in eager.generate(ids, sp)]
        want_logits = _decode_logits(eager, ids[:3])
    finally:
        eager.close()
    tp = _engine(model_dir, 2, graphs=True)
    try:
        gr = tp.runner.graph_runner
        assert gr is not None and 4 in gr.buckets and tp.runner.model._fused is not None
        got = [o.token_ids for o in tp.generate(ids, sp)]
        got_logits = _decode_logits(tp, ids[:3])
        tp.check_invariants(expect_idle=True)
    finally:
        tp.close()
    err = capfd.readouterr().err  # the follower logs to the inherited stderr, rank 0 through logging
    assert "tensor parallel rank 1: cuda_graphs=on" in err, err[-2000:]
    assert "tensor parallel rank 0: cuda_graphs=on" in caplog.text
    assert got == want
    assert got_logits.shape == want_logits.shape
    assert torch.equal(got_logits.argmax(-1), want_logits.argmax(-1))
    torch.testing.assert_close(got_logits, want_logits, atol=0.25, rtol=0.05)  # bf16, another summation order
