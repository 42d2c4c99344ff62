"""Decode memory benchmark: ``--decode-reserve ondemand`` vs ``full`` on ``halfmoon up``, one run.

    PYTHONPATH=. python -m bench.decode_memory [--output bench/results/decode_memory.json]

Two workloads per mode, each on a fresh stack (``halfmoon up --base-port 0`` as a subprocess):

* **chats**: 16 concurrent OpenAI chats without ``max_tokens`` (greedy, short answers ending on EOS)
  on the default stack; one chat alone first. Reports total time vs alone, the decode batch size over
  time (D's ``GetLoad`` polled every 50 ms) and its peak.
* **natural** (the case on-demand admission is for): 16 concurrent greedy chats that advertise
  ``max_tokens=1024`` and stop by themselves (EOS), half short answers and half long-form requests,
  so lengths are mixed and unknown to D. Decode pool: ``NATURAL_PAGES`` (140 pages, 2240 tokens):
  ``full`` reserves prompt + 1023 slots (~66 pages) per request and so runs 2 at a time, while the
  tokens the 16 actually hold at once are 2-4x the pool. Not ``max_tokens`` unset: the router then
  asks for the rest of the 8192-token context, which needs a pool of > 8192 tokens and a working
  set of 16-32k live tokens to be under pressure, too slow on a shared CPU; the **chats** workload
  covers the unset case on the default pool.
* **pressure** (known lengths, the case projection cannot win): 16 concurrent completions of 64
  prompt tokens + 128 output tokens (``ignore_eos``: every request uses all of its max_tokens) on a
  decode pool of 64 pages (1024 tokens): a working set of 192 pages, 3x the pool. The ondemand
  reserve is scaled with the pool (16 tokens; the default 128 would cover all 128 outputs, i.e. be
  ``full``).

* **pressure-unset** (the case on-demand admission is for, under pool pressure): ``halfmoon up
  --max-context 1024`` (router and workers), 14 concurrent greedy chats **without** ``max_tokens``, so
  the router asks for the rest of the 1024-token cap and ``full`` reserves 1023 slots (64 pages) for
  each; half short answers (8-24 tokens), half long-form prompts that write 180-335 tokens and end
  on EOS (``UNSET_*``: lengths measured with the default model). Decode pool ``UNSET_PAGES`` (64
  pages, 1024 tokens): one full reservation fits, two do not, so ``full`` runs one request at a
  time, while the tokens the 14 hold in all are ~2.5x the pool (``working_set_x_pool`` in the JSON).
  The router's ``--request-timeout`` and the client's are ``UNSET_TIMEOUT_S`` (1200 s): under
  ``full`` the last request waits for all the others.

For natural, pressure and pressure-unset: output tok/s, TTFT/ITL p50/p99, D's retractions, failed
requests, the per-request completion lengths and finish reasons, and the box's load average at the
start and end of the run (the box may be shared: ``os.getloadavg``).

Prints a table and writes JSON (``config``, per mode and workload ``summary``, ratios ondemand/full).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from bench import endpoints
from bench.results_file import write_result
from bench.stats import distribution, itl_gaps
from protos import common_pb2, decode_pb2_grpc

MODEL = "smollm2-135m-instruct"
CHATS = ["Say hi.", "Name a color.", "Name a fruit.", "Name a vegetable.", "Name a river.", "Name a city.",
         "Name an animal.", "Name a sport.", "Name a number.", "Name a month.", "Say hello.",
         "Name a planet.", "Name a tree.", "Name a shape.", "Name a metal.", "Name an insect."]
PRESSURE_TEXT = ("The harbour master kept a ledger of every ship that came in, its cargo, its crew and the "
                 "weather on the day it arrived. ")
PRESSURE_PAGES = 64  # decode pool of the pressure workload (page size 16)
NATURAL_PAGES = 140  # decode pool of the natural workload: 2 full reservations of prompt + 1023
NATURAL_MAX_TOKENS = 1024
NATURAL = ["Say hi.", "Name a color.", "What is 2 + 2?", "Name a fruit.", "Say thank you.",
           "Name a planet.", "What is the capital of France?", "Name a month.",
           "Write a long story about a dragon who learns to bake bread.",
           "Explain in detail how a car engine works.",
           "Write an essay about the history of the printing press.",
           "Describe, step by step, how to plant a vegetable garden.",
           "Write a long letter to a friend about your summer holiday.",
           "Explain how the water cycle works, with examples.",
           "Write a detailed guide to learning to play the guitar.",
           "Tell a long story about a sailor lost at sea."]


UNSET_CONTEXT = 1024  # --max-context of the pressure-unset stack
UNSET_PAGES = 64  # decode pool of pressure-unset: one full reservation (1023 slots, 64 pages) fits, two do not
UNSET_SHORT = NATURAL[:7]
UNSET_TIMEOUT_S = 1200  # full runs them one at a time: the last waits for all the others
# greedy output lengths on the default model (under the 1024 cap, ending on EOS): 182, 185, 221, 282,
# 327, 330, 333 tokens
UNSET_LONG = ["Explain photosynthesis to a high school student.", "Give me ten tips for better sleep.",
              "Explain the difference between weather and climate.",
              "Describe, step by step, how to plant a vegetable garden.",
              "Explain how the water cycle works, with examples.", "Explain how vaccines work.",
              "Explain in detail how a car engine works."]


class UpStack:
    """``halfmoon up`` in a subprocess; ``endpoints`` once ready. Stopped with SIGTERM on exit."""

    def __init__(self, decode_args: str, extra: list[str], log_dir: Path):
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.ep_file = log_dir / "endpoints.json"
        self.cmd = [sys.executable, "-m", "halfmoon", "up", "--base-port", "0", "--torch-threads", "1",
                    "--log-dir", str(log_dir), "--endpoints-file", str(self.ep_file),
                    f"--decode-args={decode_args}", *extra]

    def __enter__(self) -> "UpStack":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=open(self.log_dir / "up.log", "w"),
                                     start_new_session=True)
        deadline = time.monotonic() + 300
        while not self.ep_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()  # a stack still starting would outlive the bench
                raise RuntimeError(f"halfmoon up failed; see {self.log_dir}/up.log")
            time.sleep(0.2)
        time.sleep(0.2)
        self.endpoints = json.loads(self.ep_file.read_text())
        return self

    def __exit__(self, *exc) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=60)


def _stream(client, kind: str, payload) -> dict:
    """One streamed request: times (s since send) of each chunk with content, completion tokens,
    finish reason, or the error that ended it."""
    t0 = time.monotonic()
    times, usage, finish, error, prompt_tokens = [], None, None, None, 0
    try:
        if kind in ("chat", "natural"):
            extra = {"max_tokens": NATURAL_MAX_TOKENS} if kind == "natural" else {}
            it = client.chat.completions.create(model=MODEL, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                messages=[{"role": "user", "content": payload}], **extra)
            text_of = lambda c: c.choices[0].delta.content if c.choices else None  # noqa: E731
        else:
            it = client.completions.create(model=MODEL, temperature=0, stream=True, prompt=payload,
                                           max_tokens=128, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
            text_of = lambda c: c.choices[0].text if c.choices else None  # noqa: E731
        for chunk in it:
            if text_of(chunk):
                times.append(time.monotonic() - t0)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                usage, prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
    except Exception as e:  # a failed request is a result here, reported as such
        error = f"{type(e).__name__}: {e}"
    return {"times": times, "e2e": time.monotonic() - t0, "tokens": usage if usage is not None else len(times),
            "prompt_tokens": prompt_tokens, "finish": finish, "error": error}


def _poll_batch(address: str, stop: threading.Event, out: list, credentials) -> None:
    with credentials.channel(address) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        t0 = time.monotonic()
        while not stop.is_set():
            try:
                rep = stub.GetLoad(common_pb2.GetLoadRequest(), timeout=30)
            except grpc.RpcError:  # a loaded box can delay D's answer: a gap in the series, not the end
                continue
            out.append((round(time.monotonic() - t0, 2), rep.running_requests))
            time.sleep(0.05)


def _metric(address: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name) and not line.startswith("#"))


def _run(stack: UpStack, kind: str, payloads: list, timeout_s: float = 600) -> dict:
    import openai

    ep = stack.endpoints
    client = openai.OpenAI(base_url=f"http://{ep['router']['http']}/v1", api_key=ep.get("api_key") or "x",
                           timeout=timeout_s, max_retries=0)
    dec = ep["decode"][0]
    retr0 = _metric(dec["metrics"], "halfmoon_decode_retractions_total")
    stop, batch = threading.Event(), []
    poller = threading.Thread(target=_poll_batch, args=(dec["grpc"], stop, batch, endpoints.cluster_credentials(ep)),
                              daemon=True)
    poller.start()
    load0 = os.getloadavg()
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(payloads)) as ex:
        recs = list(ex.map(lambda p: _stream(client, kind, p), payloads))
    total = time.monotonic() - t0
    stop.set()
    poller.join()
    toks = sum(r["tokens"] for r in recs)
    itl = [g for r in recs for g in itl_gaps(r["times"], [1] * len(r["times"]))]
    return {"requests": len(recs), "failed": sum(r["error"] is not None for r in recs),
            "errors": sorted({r["error"] for r in recs if r["error"]}),
            "completion_tokens": [r["tokens"] for r in recs], "finish": [r["finish"] for r in recs],
            "prompt_tokens": [r["prompt_tokens"] for r in recs],
            "loadavg_1_5_15_start": [round(x, 2) for x in load0],
            "loadavg_1_5_15_end": [round(x, 2) for x in os.getloadavg()],
            "total_s": round(total, 2), "output_tokens": toks,
            "output_tok_s": round(toks / total, 2),
            "ttft_ms": distribution([r["times"][0] for r in recs if r["times"]], 1000),
            "itl_ms": distribution(itl, 1000),
            "retractions": _metric(dec["metrics"], "halfmoon_decode_retractions_total") - retr0,
            "peak_batch": max((n for _, n in batch), default=0), "batch_over_time": batch[::10]}


def bench_mode(mode: str, tmp: Path, workloads: tuple[str, ...]) -> dict:
    out = {}
    if "chats" in workloads:
        out["chats"] = _chats(mode, tmp)
    if "natural" in workloads:
        out["natural"] = _natural(mode, tmp)
    if "pressure" in workloads:
        out["pressure"] = _pressure(mode, tmp)
    if "pressure-unset" in workloads:
        out["pressure-unset"] = _pressure_unset(mode, tmp)
    return out


def _chats(mode: str, tmp: Path) -> dict:
    with UpStack(f"--decode-reserve {mode}", [], tmp / f"{mode}-chats") as st:
        alone = _run(st, "chat", CHATS[:1])
        many = _run(st, "chat", CHATS)
        many["alone_s"] = alone["total_s"]
        many["vs_alone"] = round(many["total_s"] / alone["total_s"], 2)
    return many


def _natural(mode: str, tmp: Path) -> dict:
    with UpStack(f"--decode-reserve {mode} --num-pages {NATURAL_PAGES}", [], tmp / f"{mode}-natural") as st:
        return _run(st, "natural", NATURAL)


def _pressure(mode: str, tmp: Path) -> dict:
    from transformers import AutoTokenizer

    from engine.model_store import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(MODEL)))
    prompts = [tok.decode(tok.encode(f"Entry {i}. " + PRESSURE_TEXT * 3)[:64]) for i in range(16)]
    args = f"--decode-reserve {mode} --num-pages {PRESSURE_PAGES} --num-reserved-decode-tokens 16"
    with UpStack(args, [], tmp / f"{mode}-pressure") as st:
        return _run(st, "completion", prompts)


def _pressure_unset(mode: str, tmp: Path) -> dict:
    args = f"--decode-reserve {mode} --num-pages {UNSET_PAGES}"
    extra = ["--max-context", str(UNSET_CONTEXT), f"--router-args=--request-timeout {UNSET_TIMEOUT_S}"]
    with UpStack(args, extra, tmp / f"{mode}-pressure-unset") as st:
        out = _run(st, "chat", UNSET_SHORT + UNSET_LONG, timeout_s=UNSET_TIMEOUT_S)
    held = sum(p + c for p, c in zip(out["prompt_tokens"], out["completion_tokens"]))
    out["working_set_x_pool"] = round(held / (UNSET_PAGES * 16), 2)
    return out


def _table(res: dict) -> str:
    rows = [("workload", "metric", "ondemand", "full", "ondemand/full")]
    for w, keys in (("chats", ("total_s", "alone_s", "vs_alone", "peak_batch", "retractions")),
                    ("natural", ("output_tok_s", "total_s", "output_tokens", "retractions", "failed", "peak_batch")),
                    ("pressure", ("output_tok_s", "total_s", "output_tokens", "retractions", "failed", "peak_batch")),
                    ("pressure-unset", ("output_tok_s", "total_s", "output_tokens", "retractions", "failed",
                                        "peak_batch", "working_set_x_pool"))):
        if w not in res["ondemand"]:
            continue
        for k in keys:
            a, b = res["ondemand"][w][k], res["full"][w][k]
            rows.append((w, k, a, b, round(a / b, 2) if b else "-"))
        if w != "chats":
            for k in ("ttft_ms", "itl_ms"):
                for q in ("p50", "p99"):
                    a, b = res["ondemand"][w][k][q], res["full"][w][k][q]
                    rows.append((w, f"{k} {q}", round(a, 1), round(b, 1), round(a / b, 2) if b else "-"))
    return "\n".join(f"{r[0]:<14} {r[1]:<18} {r[2]!s:>10} {r[3]!s:>10} {r[4]!s:>14}" for r in rows)


def main(argv=None) -> int:
    global NATURAL_MAX_TOKENS, NATURAL_PAGES
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default="", help="JSON result path (default: bench/results/decode_memory_<time>.json)")
    p.add_argument("--workloads", default="chats,natural,pressure,pressure-unset",
                   help="comma list: chats, natural, pressure, pressure-unset")
    p.add_argument("--natural-max-tokens", type=int, default=NATURAL_MAX_TOKENS,
                   help="max_tokens the natural workload's chats advertise (default %(default)s)")
    p.add_argument("--natural-pages", type=int, default=NATURAL_PAGES,
                   help="D's pool for the natural workload (default %(default)s: 2 full reservations of the "
                        "default max_tokens; scale it with --natural-max-tokens)")
    args = p.parse_args(argv)
    # the workload functions read the module constants: a smaller natural run (e.g. 512 / 72, which a
    # loaded 2-core box finishes inside the client's 600 s timeout) keeps the pool-to-working-set ratio
    NATURAL_MAX_TOKENS, NATURAL_PAGES = args.natural_max_tokens, args.natural_pages
    workloads = tuple(args.workloads.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="hm-decode-memory-"))
    res = {"config": {"model": MODEL, "chats": len(CHATS), "pressure_decode_pages": PRESSURE_PAGES,
                      "natural_decode_pages": NATURAL_PAGES, "natural_max_tokens": NATURAL_MAX_TOKENS,
                      "natural_requests": len(NATURAL), "unset_max_context": UNSET_CONTEXT,
                      "unset_decode_pages": UNSET_PAGES, "unset_requests": len(UNSET_SHORT + UNSET_LONG)}}
    for mode in ("ondemand", "full"):
        res[mode] = bench_mode(mode, tmp, workloads)
    print(_table(res))
    write_result(res, "decode_memory", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
