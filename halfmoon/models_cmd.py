"""`halfmoon models pull NAME` / `halfmoon models list`."""

from __future__ import annotations

import argparse
import json

from engine import model_store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    pull = sub.add_parser("pull", help="download and convert a known model into the cache")
    pull.add_argument("name", nargs="?", default=model_store.DEFAULT_MODEL)
    pull.add_argument("--force", action="store_true", help="pull again even if cached")
    ls = sub.add_parser("list", help="list known and pulled models")
    ls.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.action == "pull":
        path = model_store.pull_model(args.name, force=args.force)
        print(path)
        return 0
    rows = model_store.list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'name':28} {'pulled':7} {'MB':>8}  path")
    for r in rows:
        print(f"{r['name']:28} {'yes' if r['pulled'] else 'no':7} {r['bytes'] / 1e6:8.1f}  {r['path'] or ''}")
    return 0
