"""Decode memory benchmark: ``--decode-reserve ondemand`` vs ``full`` on ``halfmoon up``, one run.

    PYTHONPATH=. python -m bench.decode_memory [--output bench/results/decode_memory.json]

Two workloads per mode, each on a fresh stack (``halfmoon up --base-port 0`` as a subprocess):

* **chats**: 16 concurrent OpenAI chats without ``max_tokens`` (greedy, short answers ending on EOS)
  on the default stack; one chat alone first. Reports total time vs alone, the decode batch size over
  time (D's ``GetLoad`` polled every 50 ms) and its peak.
* **pressure**: 16 concurrent completions of 64 prompt tokens + 128 output tokens (``ignore_eos``) on
  a decode pool of 64 pages (1024 tokens): a working set of 192 pages, 3x the pool. The ondemand
  reserve is scaled with the pool (16 tokens; the default 128 would cover all 128 outputs, i.e. be
  ``full``). Reports output tok/s, TTFT/ITL p50/p99 and D's retractions.

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

from bench import endpoints
from bench.stats import distribution, itl_gaps
from protos import common_pb2, decode_pb2_grpc

MODEL = "smollm2-135m-instruct"
CHATS = ["Say hi.", "Name a color.", "Name a fruit.", "Name a vegetable.", "Name a river.", "Name a city.",
         "Name an animal.", "Name a sport.", "Name a number.", "Name a month.", "Say hello.",
         "Name a planet.", "Name a tree.", "Name a shape.", "Name a metal.", "Name an insect."]
PRESSURE_TEXT = ("The harbour master kept a ledger of every ship that came in, its cargo, its crew and the "
                 "weather on the day it arrived. ")
PRESSURE_PAGES = 64  # decode pool of the pressure workload (page size 16)


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
                raise RuntimeError(f"halfmoon up failed; see {self.log_dir}/up.log")
            time.sleep(0.2)
        time.sleep(0.2)
        self.endpoints = json.loads(self.ep_file.read_text())
        return self

    def __exit__(self, *exc) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=60)


def _stream(client, kind: str, payload) -> dict:
    """One streamed request: times (s since send) of each chunk with content, token count."""
    t0 = time.monotonic()
    times = []
    if kind == "chat":
        it = client.chat.completions.create(model=MODEL, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": payload}])
        text_of = lambda c: c.choices[0].delta.content if c.choices else None  # noqa: E731
    else:
        it = client.completions.create(model=MODEL, temperature=0, stream=True, prompt=payload,
                                       max_tokens=128, extra_body={"ignore_eos": True})
        text_of = lambda c: c.choices[0].text if c.choices else None  # noqa: E731
    for chunk in it:
        if text_of(chunk):
            times.append(time.monotonic() - t0)
    return {"times": times, "e2e": time.monotonic() - t0}


def _poll_batch(address: str, stop: threading.Event, out: list, credentials) -> None:
    with credentials.channel(address) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        t0 = time.monotonic()
        while not stop.is_set():
            rep = stub.GetLoad(common_pb2.GetLoadRequest(), timeout=30)
            out.append((round(time.monotonic() - t0, 2), rep.running_requests))
            time.sleep(0.05)


def _metric(address: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name) and not line.startswith("#"))


def _run(stack: UpStack, kind: str, payloads: list) -> dict:
    import openai

    ep = stack.endpoints
    client = openai.OpenAI(base_url=f"http://{ep['router']['http']}/v1", api_key=ep.get("api_key") or "x",
                           timeout=600, max_retries=0)
    dec = ep["decode"][0]
    retr0 = _metric(dec["metrics"], "halfmoon_decode_retractions_total")
    stop, batch = threading.Event(), []
    poller = threading.Thread(target=_poll_batch, args=(dec["grpc"], stop, batch, endpoints.cluster_credentials(ep)),
                              daemon=True)
    poller.start()
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(payloads)) as ex:
        recs = list(ex.map(lambda p: _stream(client, kind, p), payloads))
    total = time.monotonic() - t0
    stop.set()
    poller.join()
    toks = sum(len(r["times"]) for r in recs)
    itl = [g for r in recs for g in itl_gaps(r["times"], [1] * len(r["times"]))]
    return {"requests": len(recs), "total_s": round(total, 2), "output_tokens": toks,
            "output_tok_s": round(toks / total, 2),
            "ttft_ms": distribution([r["times"][0] for r in recs if r["times"]], 1000),
            "itl_ms": distribution(itl, 1000),
            "retractions": _metric(dec["metrics"], "halfmoon_decode_retractions_total") - retr0,
            "peak_batch": max((n for _, n in batch), default=0), "batch_over_time": batch[::10]}


def bench_mode(mode: str, tmp: Path, workloads: tuple[str, ...]) -> dict:
    out = {}
    if "chats" in workloads:
        out["chats"] = _chats(mode, tmp)
    if "pressure" in workloads:
        out["pressure"] = _pressure(mode, tmp)
    return out


def _chats(mode: str, tmp: Path) -> dict:
    with UpStack(f"--decode-reserve {mode}", [], tmp / f"{mode}-chats") as st:
        alone = _run(st, "chat", CHATS[:1])
        many = _run(st, "chat", CHATS)
        many["alone_s"] = alone["total_s"]
        many["vs_alone"] = round(many["total_s"] / alone["total_s"], 2)
    return many


def _pressure(mode: str, tmp: Path) -> dict:
    from transformers import AutoTokenizer

    from engine.model_store import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(MODEL)))
    prompts = [tok.decode(tok.encode(f"Entry {i}. " + PRESSURE_TEXT * 3)[:64]) for i in range(16)]
    args = f"--decode-reserve {mode} --num-pages {PRESSURE_PAGES} --num-reserved-decode-tokens 16"
    with UpStack(args, [], tmp / f"{mode}-pressure") as st:
        return _run(st, "completion", prompts)


def _table(res: dict) -> str:
    rows = [("workload", "metric", "ondemand", "full", "ondemand/full")]
    for w, keys in (("chats", ("total_s", "alone_s", "vs_alone", "peak_batch", "retractions")),
                    ("pressure", ("output_tok_s", "total_s", "retractions", "peak_batch"))):
        if w not in res["ondemand"]:
            continue
        for k in keys:
            a, b = res["ondemand"][w][k], res["full"][w][k]
            rows.append((w, k, a, b, round(a / b, 2) if b else "-"))
        if w == "pressure":
            for k in ("ttft_ms", "itl_ms"):
                for q in ("p50", "p99"):
                    a, b = res["ondemand"][w][k][q], res["full"][w][k][q]
                    rows.append((w, f"{k} {q}", round(a, 1), round(b, 1), round(a / b, 2) if b else "-"))
    return "\n".join(f"{r[0]:<9} {r[1]:<14} {r[2]!s:>10} {r[3]!s:>10} {r[4]!s:>14}" for r in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default="", help="JSON result path (default: bench/results/decode_memory_<time>.json)")
    p.add_argument("--workloads", default="chats,pressure", help="comma list: chats, pressure")
    args = p.parse_args(argv)
    workloads = tuple(args.workloads.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="hm-decode-memory-"))
    res = {"config": {"model": MODEL, "chats": len(CHATS), "pressure_decode_pages": PRESSURE_PAGES}}
    for mode in ("ondemand", "full"):
        res[mode] = bench_mode(mode, tmp, workloads)
    print(_table(res))
    out = Path(args.output or Path(__file__).parent / "results" / f"decode_memory_{time.strftime('%Y%m%dT%H%M%S')}.json")
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
