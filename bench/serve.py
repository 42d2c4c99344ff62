"""``halfmoon bench serve``: a serving benchmark against the router (gRPC) or an OpenAI server.

Flow: build the seeded workload → warm-up requests (not measured; prompts from another seed) →
scrape ``/metrics`` → run the load (tqdm progress) → scrape again → summary table, JSON result
(``bench/results/serve_<workload>_<target>_<UTC time>.json`` unless ``--output``), optional PNG.

The JSON result: ``config`` (every flag, the resolved endpoints), ``summary``
(:func:`bench.stats.summarize`: throughputs, TTFT/ITL/TPOT/E2E distributions in ms, goodput, token
and KV totals from the per-request usage), ``metrics`` (``/metrics`` counter deltas per URL and the
KV summary, :mod:`bench.prom_scrape`), ``timeline`` (throughput per second) and ``requests`` (one
record per request, times in seconds since the first send).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import sys
import urllib.error
from pathlib import Path
from typing import Any

from bench import prom_scrape, report, stats, target_args, workloads
from bench.load import run_load

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_REQUESTS = 64
DURATION_CAP = 4096


def add_arguments(p: argparse.ArgumentParser) -> None:
    target_args.add_target_arguments(p)
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=workloads.WORKLOADS, default="random")
    w.add_argument("--tokenizer", default="smollm2-135m-instruct",
                   help="model name or HF directory whose tokenizer.json draws synthetic prompts")
    w.add_argument("--num-requests", type=int, default=None,
                   help="requests to send, turns counting one each (default 64; with --duration only: "
                        f"until the time is up, at most {DURATION_CAP})")
    w.add_argument("--input-len", type=int, default=256, help="random: mean prompt tokens")
    w.add_argument("--output-len", type=int, default=64, help="output tokens (max_tokens) per request")
    w.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths ~ U[L(1-r), L(1+r)]")
    w.add_argument("--groups", type=int, default=4, help="shared-prefix: number of prefixes")
    w.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: prefix tokens")
    w.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: unique suffix tokens")
    w.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    w.add_argument("--user-len", type=int, default=64, help="multi-turn: tokens per user message")
    w.add_argument("--num-shots", type=int, default=5, help="gsm8k: few-shot examples")
    w.add_argument("--data-dir", default=None, help="gsm8k: folder with train/test.jsonl "
                   "(default $HALFMOON_GSM8K_DIR or ../shared/data/gsm8k)")
    w.add_argument("--advertise-max-tokens", type=int, default=None, metavar="N",
                   help="send max_tokens=N (e.g. the rest of the context) while the client stops "
                        "reading after the workload's drawn output length and cancels: the server cannot "
                        "know a request's length in advance, as with a natural stop (dummy weights never "
                        "emit EOS)")
    w.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="generate exactly --output-len tokens (default on, off for gsm8k)")
    w.add_argument("--seed", type=int, default=0)
    ld = p.add_argument_group("load")
    ld.add_argument("--concurrency", type=int, default=None,
                    help="closed loop: this many sessions in flight (default 1 without --request-rate); "
                         "with --request-rate: the in-flight cap")
    ld.add_argument("--request-rate", type=float, default=None,
                    help="open loop: Poisson session arrivals per second")
    ld.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    ld.add_argument("--warmup", type=int, default=2, help="warm-up requests (not measured)")
    o = p.add_argument_group("report")
    o.add_argument("--slo-ttft-ms", type=float, default=None)
    o.add_argument("--slo-tpot-ms", type=float, default=None)
    o.add_argument("--slo-e2e-ms", type=float, default=None)
    o.add_argument("--output", default=None, help="JSON result path")
    o.add_argument("--no-requests", action="store_true", help="leave per-request records out of the JSON")
    o.add_argument("--plot", default=None, help="write a PNG (latency CDFs, throughput over time)")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--label", default="", help="free-form label stored in the result")


def _validate(args: argparse.Namespace) -> None:
    args.count_bound = args.num_requests is not None or args.duration is None
    if args.num_requests is None:
        args.num_requests = DURATION_CAP if args.duration is not None else DEFAULT_REQUESTS
    positive = {"--num-requests": args.num_requests, "--output-len": args.output_len,
                "--input-len": args.input_len, "--groups": args.groups, "--turns": args.turns,
                "--user-len": args.user_len}
    for flag, v in positive.items():
        if v < 1:
            raise SystemExit(f"{flag}: expected >= 1, got {v}")
    for flag, v in {"--prefix-len": args.prefix_len, "--suffix-len": args.suffix_len,
                    "--warmup": args.warmup, "--num-shots": args.num_shots}.items():
        if v < 0:
            raise SystemExit(f"{flag}: expected >= 0, got {v}")
    if args.advertise_max_tokens is not None and args.advertise_max_tokens < 1:
        raise SystemExit(f"--advertise-max-tokens: expected >= 1, got {args.advertise_max_tokens}")
    if args.request_rate is not None and not args.request_rate > 0:
        raise SystemExit(f"--request-rate: expected > 0, got {args.request_rate}")
    if args.concurrency is not None and args.concurrency < 1:
        raise SystemExit(f"--concurrency: expected >= 1, got {args.concurrency}")
    if args.duration is not None and not args.duration > 0:
        raise SystemExit(f"--duration: expected > 0, got {args.duration}")


def build_sessions(args: argparse.Namespace, num: int, seed: int) -> list[workloads.Session]:
    """The workload's sessions for ``num`` requests (with ``--advertise-max-tokens``: each request
    sends that max_tokens and stops reading at its drawn output length)."""
    sessions = _workload_sessions(args, num, seed)
    if getattr(args, "advertise_max_tokens", None) is not None:
        for s in sessions:
            for r in s.requests:
                r.stop_after, r.max_tokens = r.max_tokens, args.advertise_max_tokens
    return sessions


def _workload_sessions(args: argparse.Namespace, num: int, seed: int) -> list[workloads.Session]:
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.workload != "gsm8k"
    if args.workload == "gsm8k":
        return workloads.gsm8k_prompts(num, args.num_shots, args.output_len, seed, args.data_dir, ignore_eos)
    from engine.model_store import resolve_model

    words = workloads.WordSampler(resolve_model(args.tokenizer))
    if args.workload == "random":
        return workloads.random_lengths(words, num, args.input_len, args.output_len, args.range_ratio,
                                        seed, ignore_eos)
    if args.workload == "shared-prefix":
        return workloads.shared_prefix(words, num, args.groups, args.prefix_len, args.suffix_len,
                                       args.output_len, seed, ignore_eos)
    return workloads.multi_turn(words, num, args.turns, args.user_len, args.output_len, seed, ignore_eos)


async def _served_model(target) -> str:
    try:
        return await target.served_model()
    except Exception as e:  # noqa: BLE001 - the name is informative only
        return f"unknown ({type(e).__name__})"


def _load_label(args: argparse.Namespace) -> str:
    if args.request_rate is not None:
        cap = f", max concurrency {args.concurrency}" if args.concurrency else ""
        return f"Poisson {args.request_rate:g} req/s{cap}"
    return f"concurrency {args.concurrency or 1}"


def _scrape(urls: list[str]) -> dict[str, dict[str, float]]:
    try:
        return prom_scrape.scrape_all(urls)
    except (urllib.error.URLError, OSError) as e:
        raise SystemExit(f"cannot scrape /metrics ({', '.join(urls)}): {e}; pass --no-metrics to skip") from e


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    ep = target_args.resolve(args)
    target = target_args.make_target(args, ep)
    sessions = build_sessions(args, args.num_requests, args.seed)
    warm = build_sessions(args, args.warmup, args.seed + 1_000_003) if args.warmup else []
    concurrency = args.concurrency if (args.concurrency or args.request_rate) else 1
    load_before = os.getloadavg()
    if ep.metrics_urls:
        _scrape(ep.metrics_urls)  # unreachable /metrics: fail before sending anything
    await target.start()
    try:
        if warm:
            w = await run_load(target, warm, concurrency=concurrency, max_requests=args.warmup)
            failed = [r.error for r in w.records if not r.ok]
            if failed:
                print(f"warm-up: {len(failed)}/{len(w.records)} requests failed, e.g. {failed[0]}", file=sys.stderr)
        before = _scrape(ep.metrics_urls) if ep.metrics_urls else {}
        from tqdm import tqdm

        bar = tqdm(total=args.num_requests if args.count_bound else None, desc=f"bench {args.workload}", unit="req",
                   disable=args.no_progress, file=sys.stderr)
        try:
            res = await run_load(target, sessions, concurrency=concurrency, request_rate=args.request_rate,
                                 max_requests=args.num_requests, duration_s=args.duration, seed=args.seed,
                                 progress=bar)
        finally:
            bar.close()
        after = _scrape(ep.metrics_urls) if ep.metrics_urls else {}
        model = target.model or await _served_model(target)
    finally:
        await target.close()
    slo = stats.SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    summary = stats.summarize(res.records, res.duration_s, slo)
    metrics = None
    if ep.metrics_urls:
        d = prom_scrape.delta(before, after)
        metrics = {"urls": ep.metrics_urls, "delta": d, "kv": prom_scrape.kv_summary(d, summary["completed"])}
    config = {k: v for k, v in vars(args).items() if k not in ("func",)}
    config.update(target=args.target, endpoint=target_args.describe(args, ep), model=model,
                  load=_load_label(args), metrics_urls=ep.metrics_urls,
                  # other work on the machine skews CPU figures: keep the load averages with the result
                  host={"cpus": os.cpu_count(), "loadavg_1m_before": load_before[0],
                        "loadavg_1m_after": os.getloadavg()[0]},
                  started_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    result: dict[str, Any] = {"config": config, "summary": summary, "metrics": metrics,
                              "timeline": stats.timeline(res.records, res.t0)}
    if not args.no_requests:
        result["requests"] = [r.to_json(res.t0) for r in res.records]
    result["_records"] = res.records
    return result


def _clean(o: Any) -> Any:
    """NaN/inf → None so the JSON is strict."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_clean(v) for v in o]
    return o


def run(args: argparse.Namespace) -> int:
    _validate(args)
    result = asyncio.run(_bench(args))
    records = result.pop("_records")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = Path(args.output) if args.output else RESULTS_DIR / f"serve_{args.workload}_{args.target}_{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_clean(result), indent=1, default=str) + "\n")
    print(report.summary_table(result))
    print(f"result: {out}")
    if args.plot:
        from bench.plot import write_plot

        title = f"{args.target} · {args.workload} · {result['config']['load']}"
        print(f"plot: {write_plot(args.plot, records, result['timeline'], title)}")
    return 0 if result["summary"]["completed"] > 0 else 1
