"""The `halfmoon` console script.

Each subcommand lives in its own module, which exposes ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported only when their subcommand runs, so `halfmoon models
list` does not import torch or gRPC.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from halfmoon.child_process import arm_parent_death_signal

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "models": ("halfmoon.models_cmd", "pull and list models in the local model cache"),
    "generate": ("halfmoon.generate_cmd", "stream a completion (from a running router, or --offline)"),
    "serve-transfer": ("transfer_svc.registry_main", "run the transfer registry gRPC service"),
    "serve-prefill": ("prefill_svc.main", "run a prefill worker"),
    "serve-decode": ("decode_svc.main", "run a decode worker"),
    "serve-router": ("router_svc.main", "run the router (gRPC + OpenAI HTTP)"),
    "certs": ("halfmoon.certs_cmd", "create a dev CA and per-service certificates for mTLS (up --tls)"),
    "up": ("halfmoon.launcher", "start registry, prefill, decode and router on this machine"),
    "demo": ("halfmoon.demo", "start the stack, stream a few prompts, summarize, shut down"),
    "bench": ("bench.cli", "serving benchmarks (bench serve)"),
    "eval": ("halfmoon.eval_cmd", "accuracy evals (eval gsm8k)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="halfmoon", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        build_parser().print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    name, rest = argv[0], argv[1:]
    arm_parent_death_signal()
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"halfmoon {name}", description=COMMANDS[name][1],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
