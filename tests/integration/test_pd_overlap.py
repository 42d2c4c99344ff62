"""The decode worker's overlap schedule (``--overlap-schedule on``: step n+1 is launched before the
host reads step n's tokens, the next input ids come from the device) gives the same tokens as the
co-located engine, on real processes (registry, P, D over loopback UCX, SmolLM2-135M fp32).

On CPU the overlap buys no time (a CPU forward is synchronous); these tests check its bookkeeping:
requests that end by length while a token is in flight are not launched again, the in-flight token
of a request feeds the next step, a batch that cannot overlap (logprobs) switches to the synchronous
step and back, max_tokens 1 and 2, stop token ids hit while that token is in flight, a cancel while
a step is in flight, and afterwards every page is back and no lock is held."""

from __future__ import annotations

import time

import pytest

from tests.integration.conftest import assert_idle_accounting, model_available, start_stack
from tests.integration.pd_driver import PDDriver, colocated_generate, sampling

pytestmark = pytest.mark.skipif(not model_available(), reason="SmolLM2 is not pulled (halfmoon models pull)")

TEXT = ("A small boat drifted past the harbour wall while the fishermen mended their nets and argued "
        "about the weather, the price of fuel and whose turn it was to buy the coffee. ")


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    from engine.model_store import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m-instruct")))
    ids = []
    i = 0
    while len(ids) < 300:
        ids += tok.encode(f"Day {i}. " + TEXT)
        i += 1
    return [ids[:n] for n in (5, 17, 40, 130, 300)]


def test_overlap_schedule_matches_colocated(tmp_path, prompts):
    # greedy: the 1- and 2-token answers are the first tokens of the 12-token ones (the co-located
    # batch is the same at each of those steps), so one co-located run is the reference for all
    longest = colocated_generate(prompts, 12)
    ref = {n: [t[:n] for t in longest] for n in (1, 2, 12)}
    with start_stack(tmp_path, decode_extra=["--overlap-schedule", "on"]) as st:
        drv = PDDriver(st.prefill_addr, st.decode_addr, timeout_s=180)
        # 1. greedy batches of every length (requests join and end at different steps)
        for n in (12, 1, 2):
            got = drv.generate_many(prompts, max_tokens=n, concurrency=len(prompts))
            assert [r.tokens for r in got] == ref[n], n
            assert all(r.ok and r.last.completion_tokens == n for r in got)
        # 2. a request with logprobs cannot overlap: its steps run synchronously, the others too
        calls = [drv.start(p, sampling(12, logprobs=(i == 2))) for i, p in enumerate(prompts)]
        got = [c.wait() for c in calls]
        assert [r.tokens for r in got] == ref[12]
        assert all(len(ch.logprobs) == len(ch.token_ids) for ch in got[2].chunks)  # one per token
        # 3. requests that stop on a token id while it is in flight (one step too many was launched
        #    for them: its token is dropped, their pages are freed after that step)
        stops = [ref[12][i][min(4, len(ref[12][i]) - 1)] for i in range(len(prompts))]
        calls = [drv.start(p, sampling(12, stop_token_ids=[t])) for p, t in zip(prompts, stops)]
        got = [c.wait() for c in calls]
        for r, want, t in zip(got, ref[12], stops):
            assert r.ok and r.tokens == want[:want.index(t) + 1], (r.tokens, want, t)
            assert r.last.finish_reason == "stop"
        # 4. cancel one long request while its steps are in flight; the others finish unchanged
        calls = [drv.start(p, sampling(12 if i else 200, ignore_eos=True)) for i, p in enumerate(prompts)]
        assert calls[0].first_chunk(timeout=120)
        time.sleep(0.5)
        calls[0].cancel()
        got = [c.wait() for c in calls]
        assert not got[0].ok and len(got[0].tokens) < 200
        assert [r.tokens for r in got[1:]] == ref[12][1:]
        drv.close()
        assert_idle_accounting(st)
