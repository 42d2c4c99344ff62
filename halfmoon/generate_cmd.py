"""`halfmoon generate "prompt"`: stream a completion.

``--offline`` runs the co-located engine in this process (no services). Without it the completion
comes from a running router (``--router HOST:PORT``; the remote path is added by the router side).
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.engine_args import add_engine_arguments

    parser.add_argument("prompt", help="prompt text (with --chat: the user message)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--offline", action="store_true", help="run the co-located engine in-process")
    where.add_argument("--router", default=None, help="router gRPC address HOST:PORT (remote mode)")
    parser.add_argument("--endpoints", default=None,
                        help="endpoints JSON of `halfmoon up` (default $HALFMOON_ENDPOINTS): the router "
                             "address and API key")
    parser.add_argument("--api-key", default=None,
                        help="router API key (default: $HALFMOON_API_KEY, else the one in --endpoints)")
    s = parser.add_argument_group("sampling")
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    add_engine_arguments(parser)


def sampling_params_from_args(args: argparse.Namespace):
    from engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
        stop=list(args.stop), ignore_eos=args.ignore_eos)


def run_offline(args: argparse.Namespace) -> int:
    from engine.engine import Engine
    from engine.config import ContextCapError
    from engine.engine_args import engine_config_from_args
    from engine.distributed.group import TPRankDied
    from engine.errors import InvalidRequestError, ResourceExhaustedError

    eng = None
    try:
        eng = Engine(config=engine_config_from_args(args))
        prompt = (eng.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat
                  else args.prompt)
        last = None
        for out in eng.stream(prompt, sampling_params_from_args(args)):
            sys.stdout.write(out.text)
            sys.stdout.flush()
            last = out
    except (InvalidRequestError, ResourceExhaustedError, ContextCapError) as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    except TPRankDied as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    finally:
        if eng is not None:
            eng.close()
    sys.stdout.write("\n")
    print(f"[{last.finish_reason}; prompt {last.prompt_tokens} tokens, completion "
          f"{last.completion_tokens} tokens]", file=sys.stderr)
    return 0


def run_remote(args: argparse.Namespace) -> int:
    """Stream from a running router's gRPC ``Router.Generate`` (``--router``, else ``$HALFMOON_ROUTER``,
    else 127.0.0.1:50050, where ``halfmoon up`` puts it). Exit 2 on INVALID_ARGUMENT, 1 on other errors."""
    import os

    import grpc

    from protos import common_pb2, router_pb2, router_pb2_grpc

    from bench import endpoints as endpoints_file
    from security.call_metadata import bearer_channel

    ep_path = args.endpoints or os.environ.get("HALFMOON_ENDPOINTS")
    try:
        ep = endpoints_file.load(ep_path) if ep_path else endpoints_file.Endpoints()
    except (OSError, ValueError) as e:
        print(f"error: --endpoints: {e}", file=sys.stderr)
        return 2
    address = args.router or ep.router or os.environ.get("HALFMOON_ROUTER", "127.0.0.1:50050")
    api_key = args.api_key or os.environ.get("HALFMOON_API_KEY") or ep.api_key
    try:  # an int past the proto field (int32 max_tokens/top_k, uint64 seed) is bad input, not a traceback
        sp = common_pb2.SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
            stop=list(args.stop), ignore_eos=args.ignore_eos)
        if args.seed is not None:
            sp.seed = args.seed
    except ValueError as e:
        print(f"error: INVALID_ARGUMENT: sampling flags: {e}", file=sys.stderr)
        return 2
    req = router_pb2.GenerateRequest(sampling=sp)
    if args.chat:
        req.chat.messages.add(role="user", content=args.prompt)
    else:
        req.text = args.prompt
    last = None
    try:
        with bearer_channel(address, api_key) as ch:
            for resp in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=600):
                sys.stdout.write(resp.text)
                sys.stdout.flush()
                last = resp
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()} (router {address})", file=sys.stderr)
        return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    sys.stdout.write("\n")
    u = last.usage
    print(f"[{last.finish_reason}; prompt {u.prompt_tokens} tokens ({u.cached_tokens} cached), completion "
          f"{u.completion_tokens} tokens; {last.prefill_worker} -> {last.decode_worker}, "
          f"{u.kv_pages_transferred} KV pages moved]", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    return run_offline(args) if args.offline else run_remote(args)
