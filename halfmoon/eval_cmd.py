"""``halfmoon eval gsm8k`` / ``halfmoon eval arith``: few-shot accuracy through the serving stack.

- ``gsm8k``: ``--num-shots`` examples from the GSM8K train set, then questions from the test set
  (the first ``--num-questions``, after ``--start``), data from ``--data-dir`` /
  ``$HALFMOON_GSM8K_DIR`` / ``../shared/data/gsm8k``. Small models score ~0% here (SmolLM2-135M,
  greedy), so only a larger model makes it a quality measure.
- ``arith``: a seeded synthetic arithmetic set (:mod:`bench.arith`) in the same format, where the
  default model scores well above zero: the smoke floor that tells a working pipeline from a broken
  one.

Greedy decoding, stop at a blank line or a new ``Question:``; the answer is the number after
``####``, else the last number (:func:`bench.gsm8k.extract_answer`). ``--passes 2`` sends the same
prompts again: the second pass hits the prefill and decode radix caches, must give the same tokens
(reported as token differences between passes) and should move fewer KV pages. Per pass: accuracy,
cached tokens, decode prefix tokens and KV pages/bytes moved (from the usage fields and from the
workers' ``/metrics``). The target is the router over gRPC by default, or any OpenAI endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
import time
import urllib.error
from pathlib import Path
from typing import Any

from bench import accuracy, arith, gsm8k, prom_scrape, target_args
from bench.load import run_load
from bench.request import BenchRequest
from bench.workloads import Session


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="task", required=True)
    for task, help_text, shots, qs, max_tokens in (
            ("gsm8k", "GSM8K test questions, N-shot from the train set", 5, 200, 256),
            ("arith", "seeded synthetic arithmetic (smoke floor)", 4, 100, 24)):
        p = sub.add_parser(task, help=help_text)
        target_args.add_target_arguments(p)
        p.add_argument("--num-questions", type=int, default=qs)
        p.add_argument("--num-shots", type=int, default=shots)
        p.add_argument("--max-tokens", type=int, default=max_tokens)
        p.add_argument("--concurrency", type=int, default=8)
        p.add_argument("--passes", type=int, default=1, help="sweeps over the same prompts (2: cache hits)")
        p.add_argument("--output", default=None, help="JSON result path (default: print only)")
        p.add_argument("--no-progress", action="store_true")
        if task == "gsm8k":
            p.add_argument("--data-dir", default=None,
                           help="folder with train.jsonl/test.jsonl (default $HALFMOON_GSM8K_DIR or "
                                "../shared/data/gsm8k)")
            p.add_argument("--start", type=int, default=0, help="first test-set index")
        else:
            p.add_argument("--seed", type=int, default=0, help="question seed (shots use seed + 1)")


def build_questions(args: argparse.Namespace) -> tuple[str, list[dict[str, str]]]:
    """The few-shot prefix and the question rows.

    Raises:
        SystemExit: bad counts, or the GSM8K data is missing.
    """
    for flag, v, lo in (("--num-questions", args.num_questions, 1), ("--num-shots", args.num_shots, 0),
                        ("--max-tokens", args.max_tokens, 1), ("--concurrency", args.concurrency, 1),
                        ("--passes", args.passes, 1)):
        if v < lo:
            raise SystemExit(f"{flag}: expected >= {lo}, got {v}")
    if args.task == "arith":
        return (gsm8k.few_shot_prefix(arith.make_set(args.num_shots, args.seed + 1), args.num_shots),
                arith.make_set(args.num_questions, args.seed))
    try:
        train, test = gsm8k.load("train", args.data_dir), gsm8k.load("test", args.data_dir)
    except gsm8k.DataNotFoundError as e:
        raise SystemExit(str(e)) from e
    if args.start < 0 or args.start >= len(test):
        raise SystemExit(f"--start: expected 0..{len(test) - 1}, got {args.start}")
    return gsm8k.few_shot_prefix(train, args.num_shots), test[args.start:args.start + args.num_questions]


def _scrape(urls: list[str]) -> dict[str, dict[str, float]]:
    try:
        return prom_scrape.scrape_all(urls) if urls else {}
    except (urllib.error.URLError, OSError) as e:
        raise SystemExit(f"cannot scrape /metrics ({', '.join(urls)}): {e}; pass --no-metrics to skip") from e


async def _evaluate(args: argparse.Namespace) -> dict[str, Any]:
    prefix, rows = build_questions(args)
    refs = [gsm8k.reference_answer(r["answer"]) for r in rows]
    ep = target_args.resolve(args)
    target = target_args.make_target(args, ep)
    from tqdm import tqdm

    passes: list[dict[str, Any]] = []
    pass_records = []
    await target.start()
    try:
        for k in range(args.passes):
            sessions = [Session(i, [BenchRequest(prompt=prefix + gsm8k.example(r, False), max_tokens=args.max_tokens,
                                                 temperature=0.0, stop=list(gsm8k.STOP), session_id=i, tag=i)])
                        for i, r in enumerate(rows)]
            before = _scrape(ep.metrics_urls)
            bar = tqdm(total=len(rows), desc=f"{args.task} pass {k + 1}/{args.passes}", unit="q",
                       disable=args.no_progress, file=sys.stderr)
            t = time.perf_counter()
            try:
                res = await run_load(target, sessions, concurrency=args.concurrency, progress=bar)
            finally:
                bar.close()
            wall = time.perf_counter() - t
            after = _scrape(ep.metrics_urls)
            recs = sorted(res.records, key=lambda r: r.tag)
            pass_records.append(recs)
            g = accuracy.grade(recs, refs)
            entry: dict[str, Any] = {
                "pass": k + 1, **{key: g[key] for key in ("questions", "correct", "accuracy", "invalid", "errors")},
                "wall_s": wall, "usage": accuracy.usage_totals(recs),
                "output_tokens_per_s": sum(r.output_tokens for r in recs if r.ok) / wall if wall > 0 else 0.0,
                "error_examples": sorted({r.error for r in recs if not r.ok})[:5],
            }
            if ep.metrics_urls:
                d = prom_scrape.delta(before, after)
                entry["metrics"] = {"delta": d, "kv": prom_scrape.kv_summary(d, len(recs))}
            if k > 0:
                entry["vs_pass_1"] = accuracy.compare_passes(pass_records[0], recs)
            entry["answers"] = g["answers"]
            passes.append(entry)
    finally:
        await target.close()
    by_tag = [{r.tag: r for r in p} for p in pass_records]
    questions = [{"index": i, "question": r["question"], "reference": refs[i],
                  "outputs": [p[i].text if i in p else None for p in by_tag]}
                 for i, r in enumerate(rows)]
    config = {k: v for k, v in vars(args).items()}
    config.update(endpoint=target_args.describe(args, ep), metrics_urls=ep.metrics_urls, model=target.model,
                  started_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    return {"task": args.task, "config": config, "passes": passes, "questions": questions}


def _table(result: dict[str, Any]) -> str:
    lines = [f"halfmoon eval {result['task']} ({result['config']['target']} {result['config']['endpoint']})",
             f"{'pass':>4} {'accuracy':>9} {'correct':>8} {'invalid':>8} {'errors':>7} {'cached tok':>11} "
             f"{'KV pages':>9} {'KV MB':>8} {'diff vs 1':>10} {'wall s':>7}"]
    for p in result["passes"]:
        u = p["usage"]
        pages, nbytes = u["kv_pages_transferred"], u["kv_bytes_transferred"]
        if "metrics" in p:  # the workers' own counters, when scraped, over the usage fields
            pages, nbytes = p["metrics"]["kv"]["kv_pages_transferred"], p["metrics"]["kv"]["kv_bytes_transferred"]
        diff = p["vs_pass_1"]["differing"] if "vs_pass_1" in p else "-"
        fmt = (lambda v, f: "n/a" if v is None else format(v, f))
        lines.append(f"{p['pass']:>4} {p['accuracy']:>9.3f} {p['correct']:>8} {p['invalid']:>8} {p['errors']:>7} "
                     f"{fmt(u['cached_tokens'], 'd'):>11} {fmt(pages, '.0f'):>9} "
                     f"{fmt(None if nbytes is None else nbytes / 1e6, '.2f'):>8} {diff!s:>10} {p['wall_s']:>7.1f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(_evaluate(args))
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(_table(result))
    if args.output:
        print(f"result: {args.output}")
    return 0 if all(p["errors"] < p["questions"] for p in result["passes"]) else 1
