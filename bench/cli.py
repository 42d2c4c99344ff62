"""``halfmoon bench``: ``serve`` (serving benchmark, :mod:`bench.serve`) and ``compare`` (results side by side).

``halfmoon bench compare a.json b.json`` prints the headline figures of saved ``bench serve``
results next to each other with the ratio of the first to the second (above 1 = the first is better),
e.g. halfmoon against vLLM CPU on the same workload.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import report, serve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    serve.add_arguments(sub.add_parser("serve", help="serving benchmark (router gRPC or OpenAI HTTP)"))
    cmp_ = sub.add_parser("compare", help="saved `bench serve` results side by side, with ratios")
    cmp_.add_argument("results", nargs="+", help="JSON files written by `bench serve`")
    cmp_.add_argument("--names", nargs="*", default=None, help="column names (default: labels or file names)")


def run(args: argparse.Namespace) -> int:
    if args.action == "serve":
        return serve.run(args)
    results = [json.loads(Path(p).read_text()) for p in args.results]
    names = args.names or [r["config"].get("label") or Path(p).stem for r, p in zip(results, args.results)]
    if len(names) != len(results):
        raise SystemExit(f"--names: expected {len(results)} names, got {len(names)}")
    print(report.compare_table(results, names))
    return 0
