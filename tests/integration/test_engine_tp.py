"""Tensor parallelism in the co-located engine (engine/distributed/), real rank processes under
torch.distributed (gloo, one torch thread per rank) on the default model, SmolLM2-135M (9 q heads,
3 kv heads): TP=2 is the split whose head counts do not divide (uneven kv shards 2 + 1), TP=3 the
even one.

* with fused ops on (the default: fused q/k/v and gate/up GEMMs on each rank's slices, packed
  o/down keeping their all-reduce), greedy tokens of TP=2 and 3 equal the transformers reference
  (as TP=1's do: test_engine_golden), in one continuously batched run and
  again from the radix cache; KV accounting idle afterwards; the last-token logits of an extend
  within fp32 tolerance of the reference's; each rank's pool holds only its kv heads;
* a split that cannot work (TP=4) is refused naming ``tp`` before any process starts;
* a tiny random model with one kv head (replicated on both ranks), q/k/v bias, q/k norms and a
  vocabulary 2 does not divide: TP=2 equals TP=1; a second TP engine in the process is refused;
* a follower SIGKILLed mid-generation: the forward raises TPRankDied within seconds and the other
  follower is gone too; rank 0 (``halfmoon generate --offline --tp 2``) SIGKILLed: its follower exits
  within seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from engine.distributed.group import TPRankDied
from engine.distributed.parallel_linear import PackedRowParallelLinear
from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 10
PAGE = 16


@pytest.fixture(scope="module")
def reference(model_dir):
    """(prompts, greedy tokens, last-token logits) from transformers in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [tok(s)["input_ids"] for s in (
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away, there lived a king who had three daughters. The youngest",
        "1, 2, 3, 4, 5,")]
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokens, logits = [], []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])
            out = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS, do_sample=False)
            tokens.append(out[0, len(p):].tolist())
            logits.append(ref(x).logits[0, -1].float())
    return prompts, tokens, logits


# TP=1 == transformers is tests/unit/test_engine_golden.py's; here the TP engines meet the same reference
@pytest.fixture(scope="module", params=[2, 3], ids=lambda tp: f"tp{tp}")
def engine(request, model_dir):
    eng = Engine(str(model_dir), page_size=PAGE, num_pages=96, max_running_requests=8, max_context=1024,
                 torch_threads=1, tp_size=request.param)
    yield eng
    eng.close()


def _children() -> set[int]:
    return {c.pid for c in psutil.Process().children(recursive=True)}


def test_greedy_tokens_equal_transformers_and_again_from_the_cache(engine, reference):
    prompts, want, _ = reference
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert [o.token_ids for o in outs] == want
    engine.check_invariants(expect_idle=True)
    again = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert [o.token_ids for o in again] == want
    assert again[2].cached_tokens >= PAGE  # the long prompt's full pages came from the radix cache
    engine.check_invariants(expect_idle=True)


def test_logits_within_fp32_tolerance_and_pool_holds_own_kv_heads(engine, reference):
    prompts, _, want = reference
    runner = engine.runner
    tp = engine.config.tp_size
    assert runner.kv_pool.num_kv_heads == {2: 2, 3: 1}[tp]  # rank 0's shard of SmolLM2's 3
    assert len(runner.tp.follower_pids) == tp - 1
    # fused ops (the default) run under TP: fused q/k/v + gate/up on the column slices, packed o/down
    # that keep their all-reduce
    layer = runner.model.model.layers[0]
    assert runner.model._fused is not None
    assert isinstance(layer.self_attn.o_proj, PackedRowParallelLinear)
    assert isinstance(layer.mlp.down_proj, PackedRowParallelLinear)
    # the CPU default decode attention (the C++ kernel, `make kernels`) on the rank's kv heads
    assert type(runner.backend).__name__ == "CpuPagedAttentionBackend"
    for ids, ref_logits in zip(prompts, want):
        row = runner.req_to_token_pool.alloc()
        slots = runner.allocator.alloc_slots(0, len(ids), None)
        try:
            runner.req_to_token_pool.write(row, 0, slots)
            got = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [row], [0], [ids], slots))[0]
        finally:
            runner.allocator.free_slots(slots)
            runner.req_to_token_pool.free(row)
        assert got.shape == ref_logits.shape
        torch.testing.assert_close(got, ref_logits, atol=2e-4, rtol=1e-4)


def test_a_split_that_cannot_work_names_tp_before_any_process_starts(model_dir):
    before = _children()
    with pytest.raises(InvalidRequestError) as e:
        Engine(str(model_dir), num_pages=16, max_context=256, torch_threads=1, tp_size=4)
    assert e.value.field == "tp" and "3 kv heads" in str(e.value)
    assert _children() <= before


@pytest.mark.parametrize("engine", [3], indirect=True, ids=["tp3"])
def test_follower_sigkilled_mid_generation_takes_the_engine_down(engine):
    """Runs last on the TP=3 engine (it kills it)."""
    r1, r2 = engine.runner.tp.follower_pids
    timer = threading.Timer(1.0, os.kill, (r2, signal.SIGKILL))
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(TPRankDied, match=f"rank 2 \\(pid {r2}\\) exited with signal 9"):
        engine.generate([[1] * 8], SamplingParams(max_tokens=900, temperature=0, ignore_eos=True))
    assert time.monotonic() - t0 < 1.0 + 10
    gone, alive = psutil.wait_procs([psutil.Process(r1)] if psutil.pid_exists(r1) else [], timeout=10)
    assert not alive  # the survivor did not hang in a collective
    with pytest.raises(TPRankDied):  # the engine stays down
        engine.generate([[1] * 4], SamplingParams(max_tokens=2, temperature=0))
    engine.close()  # leaves the process group: the next TP engine of this process may start


def test_rank0_sigkilled_its_follower_exits(model_dir):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "halfmoon", "generate", "--offline", "--model", str(model_dir),
                             "--tp", "2", "--torch-threads", "1", "--num-pages", "64", "--max-context", "1024",
                             "--max-tokens", "900", "--ignore-eos", "--temperature", "0", "Once upon a time"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = proc.stdout.read(1)  # streaming started: both ranks are in their decode loop
        assert first, proc.stderr.read().decode()[-2000:]
        followers = psutil.Process(proc.pid).children()
        assert len(followers) == 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        gone, alive = psutil.wait_procs(followers, timeout=10)
        assert not alive, "the follower hung after rank 0 died"
        assert time.monotonic() - t0 < 10
        assert b"Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


TINY = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 1001, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
        "attention_bias": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": True, "eos_token_id": 2, "bos_token_id": 1}


def test_replicated_kv_heads_bias_qk_norm_and_padded_vocab(tmp_path):
    """TP=2 over 1 kv head (replicated on both ranks, which split its 4 q heads), q/k/v bias, per-head
    q/k norms, tied embeddings and a vocabulary (1001) that 2 does not divide: random weights (the
    same on both), TP=2 greedy tokens equal TP=1 and the logits agree."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    prompts, sp = [[5, 6, 7, 8, 9], [100, 200]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = {}
    for tp in (1, 2):
        eng = Engine(str(tmp_path), load_format="dummy", page_size=4, num_pages=32, max_running_requests=4,
                     max_context=64, torch_threads=1, tp_size=tp)
        try:
            if tp == 2:
                assert eng.runner.kv_pool.num_kv_heads == 1 and eng.runner.num_heads == 2
                before = _children()
                with pytest.raises(InvalidRequestError, match="already runs a tensor-parallel engine"):
                    Engine(str(tmp_path), load_format="dummy", num_pages=8, max_context=64, tp_size=2)
                assert _children() <= before  # refused before any process started
            runner = eng.runner
            row, slots = runner.req_to_token_pool.alloc(), runner.allocator.alloc_slots(0, 5, None)
            runner.req_to_token_pool.write(row, 0, slots)
            logits = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [row], [0], [prompts[0]], slots))[0]
            runner.allocator.free_slots(slots)
            runner.req_to_token_pool.free(row)
            got[tp] = ([o.token_ids for o in eng.generate(prompts, sp)], logits)
            eng.check_invariants(expect_idle=True)
        finally:
            eng.close()
    assert got[2][0] == got[1][0]
    torch.testing.assert_close(got[2][1], got[1][1], atol=1e-5, rtol=1e-5)
