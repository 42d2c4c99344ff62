"""Conditional disaggregation measured on multi-turn chat: today's per-role ``cache_aware``, event
routing alone (``--policy kv_events``) and event routing with ``--local-prefill-max-tokens`` (a
request whose uncached tail on D is short is prefilled by D itself, no prefill leg), on 1P1D and
2P2D, all in one run.

    python -m bench.cond_disagg --num-requests 16 --concurrency 2 \\
        --output bench/results/cond_disagg_cpu.json

For each topology and policy it starts a fresh stack (``halfmoon up``, free ports), runs ``halfmoon
bench serve --workload multi-turn`` on it (``bench.kv_routing.run_stack``) and reports, from the
run's usage and the workers' ``/metrics`` deltas: TTFT p50/p99, ITL mean/p99 (D interleaves its
EXTEND chunks with decode steps, so local prefills show up there), prompt tokens computed on P
(prompt − P's cache hits) and on D (local prefills + resume recomputes), requests D prefilled
itself and the KV bytes moved. One JSON and one table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.kv_routing import run_stack, table

POLICIES = {"cache_aware": ["--policy", "per_role", "--prefill-policy", "cache_aware",
                            "--decode-policy", "cache_aware"],
            "kv_events": ["--policy", "kv_events"],
            "kv_events+local": ["--policy", "kv_events"]}  # + --local-prefill-max-tokens (main)
TOPOLOGIES = ((1, 1), (2, 2))
COLS = ["topology", "policy", "completed", "ttft_p50_ms", "ttft_p99_ms", "itl_mean_ms", "itl_p99_ms",
        "prefill_tokens_on_p", "prefill_tokens_on_d", "local_prefills", "kv_bytes_transferred"]


def row(topology: str, policy: str, result: dict) -> dict:
    s, kv = result["summary"], result["metrics"]["kv"]
    return {"topology": topology, "policy": policy, "completed": s["completed"], "errors": s["errors"],
            "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "itl_mean_ms": s["itl_ms"]["mean"], "itl_p99_ms": s["itl_ms"]["p99"],
            "prompt_tokens": s["tokens"]["input"],
            "prefill_tokens_on_p": kv["prefill_prompt_tokens"] - kv["prefill_cached_tokens"],
            "prefill_tokens_on_d": kv["decode_local_prefill_tokens"] + kv["decode_resume_recomputed_tokens"],
            "local_prefills": kv["decode_local_prefills"],
            "kv_bytes_transferred": kv["kv_bytes_transferred"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cond_disagg", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--local-prefill-max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="bench/results/cond_disagg_cpu.json")
    args = p.parse_args(argv)
    policies = dict(POLICIES)
    policies["kv_events+local"] = POLICIES["kv_events+local"] + [
        f"--router-args=--local-prefill-max-tokens {args.local_prefill_max_tokens}"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="cond_disagg_") as tmp:
        for n_p, n_d in TOPOLOGIES:
            topo = f"{n_p}P{n_d}D"
            for name, flags in policies.items():
                work = Path(tmp) / topo
                work.mkdir(exist_ok=True)
                rows.append(row(topo, name, run_stack(name, flags, n_p, n_d, args, work)))
    result = {"config": dict(vars(args)), "rows": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows, COLS))
    print(f"result: {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
