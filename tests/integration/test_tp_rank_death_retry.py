"""A tensor-parallel decode worker whose follower rank dies before a request's first token: the
router retries the request on the other decode worker. Real processes: registry, one P, decode-0
with ``--tp 2`` (gloo, one torch thread a rank), decode-1 with one rank, the router (round robin
over D) and the ``openai`` client over its HTTP API.

decode-0's follower is stopped (SIGSTOP) before the requests, so decode-0's first decode step
waits in its collective: one request there has only P's first token out, the next one nothing; then
the follower is SIGKILLed: decode-0 exits within seconds (one line, no traceback), the router
retries the request with no token out and migrates the other, and every completion the client gets
equals the co-located engine's greedy tokens.
"""

from __future__ import annotations

import re
import signal
import threading
import time

import openai
import psutil
import pytest

from engine.engine import Engine
from engine.sampling_params import SamplingParams
from tests.integration.conftest import MODEL, model_available, start_router, start_stack, wait_router_sees

pytestmark = pytest.mark.skipif(not model_available(), reason=f"model {MODEL} is not pulled")

PROMPT = "The capital of France is"
MAX_TOKENS = 8


def test_a_follower_killed_before_the_first_token_retries_on_the_other_decode(tmp_path, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    eng = Engine(str(model_dir), page_size=16, num_pages=16, max_running_requests=2, torch_threads=1)
    try:
        ids = tok(PROMPT)["input_ids"]
        want = tok.decode(eng.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0].token_ids)
    finally:
        eng.close()
    with start_stack(tmp_path, decode_extra=["--tp", "2"], more_decodes={"decode-1": []}) as st:
        router = start_router(st.log_dir, registry=st.registry.address, extra=["--decode-policy", "round_robin"])
        try:
            wait_router_sees(router, 3)
            http = re.search(r"READY router grpc=\S+ http=(\S+)", router.log()).group(1)
            client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused", timeout=120, max_retries=0)
            tp_d = st.decodes["decode-0"]
            follower = psutil.Process(tp_d.pid).children()[0]
            assert "pd_common.tp_rank" in " ".join(follower.cmdline())
            follower.send_signal(signal.SIGSTOP)
            # round robin: of four requests two land on decode-0 and two on decode-1, which complete.
            # decode-0 streams the first one's first token (P sampled it) and then blocks in its
            # first decode step; the second one waits behind it with nothing sent
            results, stuck = [], []
            for _ in range(4):
                t = threading.Thread(target=lambda: results.append(client.completions.create(
                    model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)), daemon=True)
                t.start()
                t.join(4)
                if t.is_alive():
                    stuck.append(t)
            assert (len(results), len(stuck)) == (2, 2), "expected two requests done on decode-1, two waiting on decode-0"
            assert tp_d.popen.poll() is None
            t0 = time.monotonic()
            follower.send_signal(signal.SIGKILL)
            assert tp_d.popen.wait(15) == 1, tp_d.log()[-3000:]
            assert time.monotonic() - t0 < 15
            assert f"rank 1 (pid {follower.pid}) exited with signal 9" in tp_d.log()
            assert "Traceback" not in tp_d.log(), tp_d.log()[-4000:]
            for t in stuck:
                t.join(60)
            assert len(results) == 4, f"a request on decode-0 did not finish elsewhere:\n{router.log()[-4000:]}"
            assert [r.choices[0].text for r in results] == [want] * 4
            assert [r.choices[0].finish_reason for r in results] == ["length"] * 4
            log = router.log()  # one retried before its first token, one migrated after it
            assert re.search(r"attempt 1 \(room \d+, prefill-0 -> decode-0\) failed before the first token", log), log[-4000:]
            assert re.search(r"decode worker decode-0 \(\S+\) failed after 1 tokens were sent", log), log[-4000:]
        finally:
            router.stop()
