"""``halfmoon up`` and ``halfmoon demo`` as a user runs them (subprocesses of the real CLI).

- ``up``: endpoints file appears, the OpenAI endpoint answers, Ctrl-C (SIGINT) stops every child
  (no orphans).
- ``demo`` (what ``make demo`` runs): real decoded answers and summary numbers > 0, including a
  decode radix-cache hit for the prompt that shares a long prefix with the previous one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.integration.conftest import MODEL, model_available

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not model_available(), reason="model not pulled (halfmoon models pull)")


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_up_serves_and_ctrl_c_stops_everything(tmp_path):
    ep_file = tmp_path / "endpoints.json"
    proc = subprocess.Popen([sys.executable, "-m", "halfmoon", "up", "--model", MODEL, "--base-port", "0",
                             "--kv-memory-mb", "64", "--log-dir", str(tmp_path / "logs"),
                             "--endpoints-file", str(ep_file)], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ep_file.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        ep = json.loads(ep_file.read_text())
        pids = [ep["router"]["pid"], ep["registry"]["pid"]] + [w["pid"] for r in ("prefill", "decode") for w in ep[r]]
        assert all(_alive(p) for p in pids)
        assert ep["auth"] == "token" and len(ep["cluster_token"]) >= 32   # made fresh by this `up`
        client = openai.OpenAI(base_url=f"http://{ep['router']['http']}/v1", api_key=ep.get("api_key") or "unused",
                               max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=6, temperature=0)
        assert r.choices[0].message.content.strip() and r.usage.completion_tokens > 0
        gen = subprocess.run([sys.executable, "-m", "halfmoon", "generate", "--endpoints", str(ep_file),
                              "--max-tokens", "6", "The capital of France is"], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=120)
        assert gen.returncode == 0, gen.stderr
        assert gen.stdout.strip() and "completion 6 tokens" in gen.stderr
        os.kill(ep["decode"][0]["pid"], signal.SIGKILL)   # a worker dies: up says so and keeps running
        time.sleep(1.5)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "ENDPOINTS " in out and ep["router"]["grpc"] in out
        assert "decode-0 exited (rc=-9); the stack serves on without it" in out
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "children outlived the launcher"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_make_demo_prints_real_answers_and_summary():
    out = subprocess.run([sys.executable, "-m", "halfmoon", "demo", "--model", MODEL, "--kv-memory-mb", "64",
                          "--max-tokens", "24"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    answers = re.findall(r">>> \[(.+?)\] .*\n(.*)\n", text)
    assert [a for a, _ in answers] == ["chat", "plain", "shared prefix 1", "shared prefix 2"], text
    assert all(len(ans.strip()) > 3 for _, ans in answers), text
    assert "Paris" in answers[0][1]  # the model knows this one; greedy decoding is deterministic
    rows = {m.group(1).strip(): [float(x) for x in m.group(2).split()]
            for m in re.finditer(r"^(chat|plain|shared prefix \d)\s+([\d.\s]+?)\s+decode-\d+$", text, re.M)}
    assert len(rows) == 4, text
    for name, (ttft, toks, tps, prompt, cached, dprefix, pages, nbytes) in rows.items():
        assert ttft > 0 and toks > 0 and prompt > 0 and nbytes >= 0, (name, text)
    assert rows["chat"][2] > 0 and rows["chat"][6] > 0 and rows["chat"][7] > 0      # tok/s, pages, bytes
    second = rows["shared prefix 2"]
    assert second[5] >= 64 and second[4] >= 64          # decode radix hit + prefill cache hit
    assert second[6] < rows["shared prefix 1"][6]       # fewer pages moved: only the delta
    assert "stopped." in text
