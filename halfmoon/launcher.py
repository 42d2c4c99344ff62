"""``halfmoon up``: the whole stack on this machine — registry, N prefill, M decode workers and the
router — as child processes on loopback.

    halfmoon up --prefill 1 --decode 1                     # ports from --base-port 50050
    halfmoon up --prefill 2 --decode 2 --base-port 0 --endpoints-file /tmp/hm.json
    halfmoon up --prefill-device cuda:0 --decode-device cuda:1 --dtype bfloat16   # P and D on two GPUs

Each child runs ``python -m halfmoon <serve-...>`` in its own session (process group), with
``PR_SET_PDEATHSIG`` so it dies with the launcher even on SIGKILL; its output goes to
``<log-dir>/<name>.log``. ``up`` waits until every process printed its ready line and the router
reports all N + M workers healthy, prints the endpoints (a table, and one line
``ENDPOINTS {json}``; also written to ``--endpoints-file``), then waits for Ctrl-C / SIGTERM and
stops the router, the workers and the registry in that order: SIGTERM to each process group, then
SIGKILL after ``--stop-timeout`` seconds. A router or registry that dies stops the stack (exit 1).

Port plan with ``--base-port B`` (0 = every port picked free by its process): router gRPC B, HTTP
B+1, metrics B+2; registry gRPC B+3, metrics B+4; worker k (prefill first, then decode) gRPC
B+10+2k, metrics B+11+2k. Threads: each worker rank gets ``max(1, cores // ranks)`` torch threads,
ranks = N x ``--prefill-tp`` + M x ``--decode-tp`` (``halfmoon.worker_plan``).
Devices: ``--prefill-device`` / ``--decode-device`` take one device or a comma list that the
workers of that role take in turn (``--decode 2 --decode-device cuda:1,cuda:2``); on CUDA the
workers pick flashinfer attention and CUDA graphs themselves, and their transfer engines let UCX
choose its transports (cuda_ipc between GPUs of one host).
Credentials (``halfmoon.stack_credentials``): an ephemeral cluster token and API key by default,
mTLS with ``--tls``, none with ``--no-auth``; the ENDPOINTS JSON carries what clients need.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import sys
import time
from pathlib import Path

from engine.engine_args import int_at_least
from engine.model_store import DEFAULT_MODEL
from halfmoon.stack import Stack, StackError
from halfmoon.stack_config import StackConfig
from halfmoon.stack_credentials import add_auth_arguments, auth_mode, describe
from router_svc.policies import POLICY_NAMES

# Prompts whose uncached part is at most this many tokens are prefilled on D (conditional
# disaggregation, as Dynamo's max_local_prefill_length): on the 2-core AMD box with --cpu-share on,
# the 193-token prompts of bench.cpu_peer went 0.83x -> 1.00x vLLM CPU's tok/s at c=1 and
# 1.03x -> 1.20x at c=8 (docs/architecture.md, "Conditional disaggregation"); the GPU chart uses it too.
LOCAL_PREFILL_MAX_TOKENS = 256

__all__ = ["Stack", "StackConfig", "StackError", "add_arguments", "config_from_args", "print_endpoints",
           "role_args", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or HF directory")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--base-port", type=int, default=50050, help="first port of the plan (0 = all free ports)")
    p.add_argument("--host", default="127.0.0.1", help="bind address of every process")
    p.add_argument("--policy", default=None, choices=("per_role", "kv_events"),
                   help="router: kv_events (the default; per_role when --prefill-policy or --decode-policy "
                        "is given) or per_role (--prefill-policy / --decode-policy); kv_events: the pair "
                        "together, from the workers' KV events)")
    p.add_argument("--prefill-policy", default=None, choices=POLICY_NAMES,
                   help="how the router picks a prefill worker (per_role; default cache_aware)")
    p.add_argument("--decode-policy", default=None, choices=POLICY_NAMES,
                   help="how the router picks a decode worker (per_role; default cache_aware)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (workers and router)")
    p.add_argument("--kv-memory-mb", type=float, default=384.0,
                   help="KV pool per prefill worker (MiB); the default holds one full-context (8192-token) "
                        "request of the default model (fp32, 46 KB per token)")
    p.add_argument("--decode-kv-memory-mb", type=float, default=1024.0,
                   help="KV pool per decode worker (MiB); decode holds every running request's prompt "
                        "and output, so it needs more than prefill (the default serves ~30 concurrent "
                        "chats without max_tokens)")
    p.add_argument("--torch-threads", type=int, default=0, help="per worker (0 = cores / workers, at least 1)")
    p.add_argument("--prefill-tp", type=int_at_least(1), default=1,
                   help="tensor-parallel ranks of each prefill worker (its --tp; on CUDA rank r uses the "
                        "worker's device index + r); the torch threads are split over all ranks")
    p.add_argument("--decode-tp", type=int_at_least(1), default=1,
                   help="tensor-parallel ranks of each decode worker (its --tp)")
    p.add_argument("--prefill-device", default="cpu",
                   help="device of the prefill workers: cpu | cuda:N, or a comma list taken in turn")
    p.add_argument("--decode-device", default="cpu",
                   help="device of the decode workers: cpu | cuda:N, or a comma list taken in turn")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and KV dtype of every worker, whatever its device (pass bfloat16 for GPUs)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights (--model: a shape name, or a dir with config.json + tokenizer)")
    p.add_argument("--prefill-args", default="", help="extra flags of every prefill worker, one string "
                   "(e.g. \"--chunked-prefill-size 1024\"; see halfmoon serve-prefill --help; a lone flag "
                   "needs the = form: --prefill-args=--kv-checksums)")
    p.add_argument("--decode-args", default="", help="extra flags of every decode worker, one string "
                   "(e.g. \"--overlap-schedule off\"; see halfmoon serve-decode --help). P and D must "
                   "agree on --kv-layout: pass it in both --prefill-args and --decode-args")
    p.add_argument("--router-args", default="", help="extra flags of the router, one string (e.g. "
                   "\"--local-prefill-max-tokens 256\" with --policy kv_events; see halfmoon serve-router --help)")
    p.add_argument("--max-context", type=int, default=None, metavar="N",
                   help="tokens per request, prompt + output, for the router and every worker (vLLM's "
                        "--max-model-len; default: the model's window). A smaller cap lets D's pool hold "
                        "more requests that leave max_tokens unset (they ask for the rest of it)")
    p.add_argument("--registry", default="memory", choices=["memory", "etcd"],
                   help="etcd: start a local etcd (Debian etcd-server) on loopback and keep the "
                        "registry's records there")
    p.add_argument("--local-prefill-max-tokens", type=int, default=None, metavar="N",
                   help="with --policy kv_events: a prompt whose uncached part is at most N tokens is "
                        "prefilled by the decode worker itself, no prefill leg or transfer (the router's flag; "
                        f"default {LOCAL_PREFILL_MAX_TOKENS}, 0 = every prompt through a prefill worker)")
    p.add_argument("--cpu-share", default="on", choices=["on", "off"],
                   help="on (the default): co-located CPU workers share the cores (a busy worker computes on "
                        "those the idle ones leave; short OpenMP spin, halfmoon.core_sharing); off: each keeps "
                        "its --torch-threads, OpenMP's default spin")
    p.add_argument("--log-dir", default="", help="child logs (default: a new temp dir)")
    p.add_argument("--endpoints-file", default="", help="also write the endpoints JSON here")
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds for every process to be ready and the router to see all workers")
    p.add_argument("--stop-timeout", type=float, default=10.0,
                   help="seconds each group has after SIGTERM before SIGKILL")
    add_auth_arguments(p)


def role_args(role: str, text: str) -> list[str]:
    """``--prefill-args`` / ``--decode-args`` / ``--router-args`` split like a shell does, then parsed by that role's own
    parser, so a typo stops ``up`` before any process starts.

    Raises:
        SystemExit: unbalanced quotes, an unknown flag or a bad value (one line naming the flag).
    """
    import importlib

    try:
        argv = shlex.split(text)
    except ValueError as e:
        raise SystemExit(f"up: --{role}-args: {e}") from None

    class _Parser(argparse.ArgumentParser):
        def error(self, message):
            raise SystemExit(f"up: --{role}-args: {message} (see halfmoon serve-{role} --help)")

    parser = _Parser(prog=f"halfmoon serve-{role}", add_help=False)
    importlib.import_module(f"{role}_svc.main").add_arguments(parser)
    parser.parse_args(argv)
    return argv


def config_from_args(args: argparse.Namespace) -> StackConfig:
    if args.prefill < 1 or args.decode < 1:
        raise SystemExit("up: --prefill and --decode must be >= 1")
    for flag, spec in (("--prefill-device", args.prefill_device), ("--decode-device", args.decode_device)):
        for dev in spec.split(","):
            if not re.fullmatch(r"cpu|cuda(:\d+)?", dev.strip()):
                raise SystemExit(f"up: {flag}: {dev.strip()!r} is not cpu, cuda or cuda:N")
    if args.max_context is not None and args.max_context <= 0:
        raise SystemExit(f"up: --max-context must be > 0, got {args.max_context}")
    extra = {"prefill": role_args("prefill", args.prefill_args), "decode": role_args("decode", args.decode_args)}
    for role, argv in extra.items():
        if any(a == "--tp" or a.startswith("--tp=") for a in argv):
            raise SystemExit(f"up: --{role}-args: pass --{role}-tp instead of --tp (the thread budget counts ranks)")
    if args.policy is None:
        args.policy = "per_role" if (args.prefill_policy or args.decode_policy) else "kv_events"
    if args.policy == "kv_events" and (args.prefill_policy or args.decode_policy):
        raise SystemExit("up: --prefill-policy / --decode-policy are for --policy per_role")
    if args.local_prefill_max_tokens is None:
        args.local_prefill_max_tokens = LOCAL_PREFILL_MAX_TOKENS if args.policy == "kv_events" else 0
    elif args.policy != "kv_events" and args.local_prefill_max_tokens:
        raise SystemExit("up: --local-prefill-max-tokens needs --policy kv_events")
    if args.local_prefill_max_tokens < 0:
        raise SystemExit(f"up: --local-prefill-max-tokens must be >= 0, got {args.local_prefill_max_tokens}")
    router = role_args("router", args.router_args)
    if any(a.split("=")[0] == "--local-prefill-max-tokens" for a in router):
        raise SystemExit("up: --router-args: pass up's own --local-prefill-max-tokens")
    if args.policy == "kv_events" and args.local_prefill_max_tokens:
        router += ["--local-prefill-max-tokens", str(args.local_prefill_max_tokens)]
    return StackConfig(auth=auth_mode(args), tls_dir=args.tls_dir, model=args.model, prefill=args.prefill, decode=args.decode, base_port=args.base_port,
                       host=args.host, policy=args.policy, prefill_policy=args.prefill_policy or "cache_aware",
                       decode_policy=args.decode_policy or "cache_aware",
                       page_size=args.page_size, kv_memory_mb=args.kv_memory_mb,
                       decode_kv_memory_mb=args.decode_kv_memory_mb, torch_threads=args.torch_threads,
                       prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
                       log_dir=args.log_dir, ready_timeout=args.ready_timeout, stop_timeout=args.stop_timeout,
                       prefill_device=args.prefill_device, decode_device=args.decode_device, dtype=args.dtype,
                       load_format=args.load_format, registry=args.registry, max_context=args.max_context,
                       role_args=extra, cpu_share=args.cpu_share == "on",
                       router_args=router)


def print_endpoints(ep: dict, out=sys.stdout) -> None:
    r = ep["router"]
    print(f"halfmoon is up ({ep['model']}; logs in {ep['log_dir']})", file=out)
    print(f"  router    gRPC {r['grpc']}   OpenAI HTTP http://{r['http']}/v1   metrics http://{r['metrics']}/metrics",
          file=out)
    print(f"  registry  gRPC {ep['registry']['grpc']}   metrics http://{ep['registry']['metrics']}/metrics", file=out)
    for role in ("prefill", "decode"):
        for w in ep[role]:
            print(f"  {w['worker_id']:<9} gRPC {w['grpc']}   metrics http://{w['metrics']}/metrics", file=out)
    for line in describe(ep):
        print(line, file=out)
    print("ENDPOINTS " + json.dumps(ep), file=out, flush=True)


def run(args: argparse.Namespace) -> int:
    stop = {"sig": None, "started": False}

    def on_signal(sig, _frame):
        stop["sig"] = sig
        if not stop["started"]:
            raise KeyboardInterrupt  # interrupt start-up; `finally` stops what runs

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stack = Stack(config_from_args(args))
    rc = 0
    try:
        ep = stack.start()
        stop["started"] = True
        print_endpoints(ep)
        if args.endpoints_file:
            Path(args.endpoints_file).write_text(json.dumps(ep, indent=1))
        reported: set[str] = set()
        while stop["sig"] is None:
            dead = stack.dead()
            core = [p for p in dead if p.name in ("router", "registry")]
            if core:
                print(f"{core[0].name} exited (rc={core[0].popen.returncode}); stopping. Log tail:\n"
                      f"{core[0].tail()}", file=sys.stderr)
                rc = 1
                break
            for p in dead:  # a worker that dies is said once; the router serves on with the others
                if p.name not in reported:
                    reported.add(p.name)
                    print(f"{p.name} exited (rc={p.popen.returncode}); the stack serves on without it. "
                          f"Log tail:\n{p.tail()}", file=sys.stderr, flush=True)
            time.sleep(0.2)
    except StackError as exc:
        print(f"up: {exc}", file=sys.stderr)
        rc = 1
    except KeyboardInterrupt:
        rc = 130
    finally:
        stack.stop()
    return rc
