"""Router policies compared on one workload, same run: today's per-role ``cache_aware`` vs
``--policy kv_events`` (joint P/D choice from the workers' KV events).

    python -m bench.kv_routing --prefill 2 --decode 2 --num-requests 32 --concurrency 4 \\
        --output bench/results/kv_routing_2p2d.json

For each policy it starts a fresh stack (``halfmoon up``, free ports), runs ``halfmoon bench serve
--workload multi-turn`` on it, stops it, and reports TTFT p50/p99 and the prompt tokens P computed
(prompt tokens minus P's cache hits, from usage) in one JSON and one table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POLICIES = {"cache_aware": ["--policy", "per_role", "--prefill-policy", "cache_aware",
                            "--decode-policy", "cache_aware"],
            "kv_events": ["--policy", "kv_events"]}


def _halfmoon(*argv: str) -> list[str]:
    return [sys.executable, "-m", "halfmoon", *argv]


def run_policy(name: str, args: argparse.Namespace, work: Path) -> dict:
    """One stack with policy ``name``, one bench serve run on it; returns bench serve's summary."""
    return run_stack(name, POLICIES[name], args.prefill, args.decode, args, work)["summary"]


def run_stack(name: str, up_flags: list[str], prefill: int, decode: int, args: argparse.Namespace,
              work: Path) -> dict:
    """A fresh ``halfmoon up`` with ``up_flags``, one ``bench serve --workload multi-turn`` run on it
    (``args``: turns, user_len, output_len, num_requests, concurrency, seed); returns bench serve's
    whole result (``summary`` and the ``metrics`` deltas of every worker)."""
    ep_file, out = work / f"{name}_endpoints.json", work / f"{name}_serve.json"
    up = subprocess.Popen(_halfmoon("up", "--prefill", str(prefill), "--decode", str(decode),
                                    "--base-port", "0", "--kv-memory-mb", "64", "--decode-kv-memory-mb", "128",
                                    "--log-dir", str(work / name), "--endpoints-file", str(ep_file),
                                    *up_flags),
                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not ep_file.exists():
            if up.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kv_routing: halfmoon up ({name}) did not start; logs in {work / name}")
            time.sleep(0.5)
        subprocess.run(_halfmoon("bench", "serve", "--endpoints", str(ep_file), "--workload", "multi-turn",
                                 "--turns", str(args.turns), "--user-len", str(args.user_len),
                                 "--output-len", str(args.output_len), "--num-requests", str(args.num_requests),
                                 "--concurrency", str(args.concurrency), "--seed", str(args.seed),
                                 "--no-progress", "--no-requests", "--output", str(out), "--label", name),
                       check=True, stdout=subprocess.DEVNULL)
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(60)
    return json.loads(out.read_text())


def row(name: str, s: dict) -> dict:
    t = s["tokens"]
    computed = t["input"] - t["cached"] if t["input"] is not None and t["cached"] is not None else None
    return {"policy": name, "completed": s["completed"], "errors": s["errors"],
            "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "prompt_tokens": t["input"], "prefill_cached_tokens": t["cached"],
            "prefill_tokens_computed": computed, "decode_prefix_tokens": t["decode_prefix"],
            "kv_bytes_transferred": s["kv_usage"]["bytes_transferred"]}


TABLE_COLS = ["policy", "completed", "ttft_p50_ms", "ttft_p99_ms", "prompt_tokens", "prefill_tokens_computed",
              "decode_prefix_tokens", "kv_bytes_transferred"]


def table(rows: list[dict], cols: list[str] = TABLE_COLS) -> str:
    """A markdown table of ``rows`` over ``cols`` (floats rounded)."""
    fmt = lambda v: f"{v:.0f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kv_routing", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="bench/results/kv_routing.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kv_routing_") as tmp:
        rows = [row(name, run_policy(name, args, Path(tmp))) for name in POLICIES]
    result = {"config": {k: v for k, v in vars(args).items()}, "rows": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))
    print(f"result: {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
