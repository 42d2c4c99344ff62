"""``halfmoon demo``: start the stack (``halfmoon up``), stream a handful of real prompts through the
router's gRPC API to the terminal, print a summary, shut everything down.

The prompts: a chat question, a plain-text completion, and two chat requests that share a long
system prompt, so the second one finds the shared pages in the decode worker's radix cache (its
``decode_prefix_tokens`` > 0: only the delta pages cross from prefill to decode) and in the prefill
worker's cache (``cached_tokens`` > 0). Greedy decoding, so runs are reproducible.

Summary per request: TTFT (seconds to the first streamed token), decode tokens/s (tokens after the
first / seconds after the first), prompt tokens, cached tokens (prefill hit), decode prefix tokens
(decode hit) and the KV pages / bytes moved from prefill to decode.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import grpc

from halfmoon.launcher import Stack, StackError, add_arguments as add_up_arguments, config_from_args
from protos import common_pb2, router_pb2, router_pb2_grpc
from security.call_metadata import bearer_channel

SHARED_SYSTEM = (
    "You are a patient teacher of astronomy for curious children. Keep every answer to two or three short "
    "sentences, use simple words, give one concrete example, and never invent facts. The Moon orbits the "
    "Earth about once every 27 days; we see phases because sunlight hits the Moon from different angles as "
    "it moves. A half moon is what we see when half of the lit side faces us. The Sun is a star, and the "
    "planets travel around it on nearly circular paths. Stars look like points because they are very far away."
)

PROMPTS: list[tuple[str, dict]] = [
    ("chat", {"chat": [("user", "What is the capital of France? Answer in one sentence.")]}),
    ("plain", {"text": "The three primary colors are"}),
    ("shared prefix 1", {"chat": [("system", SHARED_SYSTEM), ("user", "Why does the Moon have phases?")]}),
    ("shared prefix 2", {"chat": [("system", SHARED_SYSTEM), ("user", "What is a half moon?")]}),
]


@dataclass
class Result:
    label: str
    text: str
    tokens: int
    ttft: float
    seconds: float
    usage: router_pb2.Usage
    decode_worker: str
    finish: str

    @property
    def tokens_per_s(self) -> float:
        gen = self.seconds - self.ttft
        return (self.tokens - 1) / gen if self.tokens > 1 and gen > 0 else 0.0


def build_request(spec: dict, max_tokens: int) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens))
    if "text" in spec:
        req.text = spec["text"]
    else:
        req.chat.SetInParent()
        for role, content in spec["chat"]:
            req.chat.messages.add(role=role, content=content)
    return req


def stream_one(stub, label: str, spec: dict, max_tokens: int, out=sys.stdout) -> Result:
    shown = spec.get("text") or spec["chat"][-1][1]
    print(f"\n>>> [{label}] {shown}", file=out)
    start = time.monotonic()
    ttft, tokens, pieces, last = 0.0, 0, [], None
    for resp in stub.Generate(build_request(spec, max_tokens), timeout=300):
        if resp.token_ids and not ttft:
            ttft = time.monotonic() - start
        tokens += len(resp.token_ids)
        pieces.append(resp.text)
        out.write(resp.text)
        out.flush()
        last = resp
    print("", file=out)
    return Result(label, "".join(pieces), tokens, ttft, time.monotonic() - start, last.usage,
                  last.decode_worker, last.finish_reason)


def print_summary(results: list[Result], out=sys.stdout) -> None:
    print("\nsummary", file=out)
    head = f"{'request':<16} {'TTFT s':>7} {'tok':>4} {'tok/s':>6} {'prompt':>6} {'cached':>6} {'D-prefix':>8} " \
           f"{'KV pages':>8} {'KV bytes':>10}  decode worker"
    print(head, file=out)
    for r in results:
        u = r.usage
        print(f"{r.label:<16} {r.ttft:7.3f} {r.tokens:4d} {r.tokens_per_s:6.1f} {u.prompt_tokens:6d} "
              f"{u.cached_tokens:6d} {u.decode_prefix_tokens:8d} {u.kv_pages_transferred:8d} "
              f"{u.kv_bytes_transferred:10d}  {r.decode_worker}", file=out)
    tot_tokens = sum(r.tokens for r in results)
    print(f"total: {tot_tokens} tokens, mean TTFT {sum(r.ttft for r in results) / len(results):.3f} s, "
          f"{sum(r.usage.cached_tokens for r in results)} cached tokens, "
          f"{sum(r.usage.decode_prefix_tokens for r in results)} decode-prefix tokens, "
          f"{sum(r.usage.kv_pages_transferred for r in results)} KV pages / "
          f"{sum(r.usage.kv_bytes_transferred for r in results)} bytes moved", file=out, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_up_arguments(p)
    # every prompt through a prefill worker: the demo shows the disaggregated path (KV pages moved,
    # the prefill cache and D's radix hit); `up` alone serves short prompts on D
    p.set_defaults(base_port=0, local_prefill_max_tokens=0)
    p.add_argument("--max-tokens", type=int, default=40, help="tokens per answer")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    print(f"starting halfmoon: registry, {cfg.prefill} prefill, {cfg.decode} decode, router ({cfg.model}) ...",
          flush=True)
    try:
        with Stack(cfg) as stack:
            ep = stack.endpoints
            print(f"up: router gRPC {ep['router']['grpc']}, OpenAI HTTP http://{ep['router']['http']}/v1 "
                  f"(logs in {ep['log_dir']})", flush=True)
            with bearer_channel(ep["router"]["grpc"], ep.get("api_key")) as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                results = [stream_one(stub, label, spec, args.max_tokens) for label, spec in PROMPTS]
            print_summary(results)
    except StackError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"demo: request failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print("stopped.", flush=True)
    return 0
