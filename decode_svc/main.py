"""`halfmoon serve-decode`: a decode worker (gRPC halfmoon.v1.Decode + health + reflection + /metrics).

    halfmoon serve-decode --model smollm2-135m-instruct --port 7002 --metrics-port 9402 \
        --registry 127.0.0.1:50050 --worker-id decode-0 --page-size 16 --kv-memory-mb 512
"""

from __future__ import annotations

import argparse
import logging

from engine.engine_args import non_negative_float, non_negative_int
from engine.scheduler.retraction import MAX_RETRACTIONS
from pd_common.worker_runtime import Worker, add_common_arguments, engine_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, "decode")
    parser.add_argument("--overlap-schedule", default="auto", choices=["auto", "on", "off"],
                        help="launch decode step n+1 before reading step n's tokens (greedy batches); "
                             "auto: on for CUDA devices, off on CPU (where a step is synchronous anyway)")
    parser.add_argument("--decode-reserve", default="ondemand", choices=["ondemand", "full"],
                        help="ondemand: admit a request for its prompt + --num-reserved-decode-tokens, "
                             "grow its pages as it decodes and retract requests when the pool runs "
                             "short; full: reserve prompt + max_tokens - 1 slots up front")
    parser.add_argument("--num-reserved-decode-tokens", type=int, default=128,
                        help="decode slots (tokens) admitted with the prompt in ondemand mode")
    parser.add_argument("--init-new-token-ratio", type=float, default=0.7,
                        help="admission projects a request to still generate this share of its remaining "
                             "tokens (clipped); decays per step to --min-new-token-ratio, back up on retraction")
    parser.add_argument("--min-new-token-ratio", type=float, default=0.1,
                        help="floor of the projection's ratio")
    parser.add_argument("--max-retractions", type=non_negative_int, default=MAX_RETRACTIONS,
                        help="a request retracted this often is pinned: not chosen again while any "
                             "other request can be")
    parser.add_argument("--queue-keepalive", type=non_negative_float, default=10.0,
                        help="seconds between empty DecodeChunks on a Generate stream that has sent "
                             "nothing yet while its request waits in D (admission queue, KV wait): the "
                             "router's --first-token-timeout then counts from D's last sign of life; 0 = off")
    parser.add_argument("--stream-coalesce", default="on", choices=["on", "off"],
                        help="on: a Generate stream that fell behind the decode steps sends the tokens it "
                             "has in one DecodeChunk; off: one DecodeChunk per token (the old path, for "
                             "comparison: bench.decode_host)")
    parser.add_argument("--stream-server", default="aio", choices=["aio", "threads"],
                        help="aio: Generate streams are tasks on one grpc.aio event loop, a decode step's "
                             "tokens handed to them at once; threads: one gRPC server thread per open "
                             "stream, woken per token (the old path, for comparison: bench.decode_host)")


def run(args: argparse.Namespace) -> int:
    from decode_svc.peers import PrefillPeers
    from decode_svc.quarantine import FencePolicy
    from decode_svc.scheduler import DecodeScheduler
    from decode_svc.server import DecodeServicer
    from pd_common.drain import Drain
    from pd_common.tokenizer import grammar_compiler, load_tokenizer
    from engine.model_runner import ModelRunner
    from protos import decode_pb2, decode_pb2_grpc

    if args.fence_timeout is not None:
        raise SystemExit("--fence-timeout is gone: a live P is never timed out of its pages any more; "
                         "quarantined pages wait for --kv-write-window (sent to P) + --fence-margin "
                         "past SetDestination's deadline (docs/architecture.md, Fencing one-sided writes)")
    w = Worker(args, "decode")
    # rows: running requests + as many pre-allocated/transferring ones, which hold a row while they
    # wait for KV without taking a running slot
    runner = ModelRunner(engine_config(args, 2 * args.max_running_requests), follower=w.follower_spec())
    transfer = w.start_transfer(runner)
    tok = load_tokenizer(runner, args.model)
    holder = {}
    overlap = args.overlap_schedule == "on" or (args.overlap_schedule == "auto" and runner.device.type == "cuda")
    logging.getLogger("halfmoon.decode").info("overlap schedule: %s (--overlap-schedule %s)",
                                              "on" if overlap else "off", args.overlap_schedule)
    peers = PrefillPeers(lambda msg: holder["s"].post(msg), registry=w.registry, credentials=w.credentials)
    sched = DecodeScheduler(runner, transfer, peers, segment_name=transfer.name,
                            eos_token_ids=runner.model_config.eos_token_ids, tokenizer=tok,
                            max_running=args.max_running_requests,
                            disable_radix_cache=args.disable_decode_radix_cache,
                            checksums=args.kv_checksums, kv_wait_timeout_s=args.kv_wait_timeout,
                            fence=FencePolicy(peers.rpc_timeout_s, args.kv_write_window, args.fence_margin),
                            overlap_schedule=overlap, decode_reserve=args.decode_reserve,
                            reserved_decode_tokens=args.num_reserved_decode_tokens,
                            max_retractions=args.max_retractions,
                            new_token_ratio=(args.init_new_token_ratio, args.min_new_token_ratio),
                            cpu_share=w.cpu_share)
    holder["s"] = sched
    w.attach_kv_events(sched)
    sched.start()
    aio = args.stream_server == "aio"
    kw = dict(vocab_size=runner.vocab_size, max_context=runner.max_context, tokenizer=tok,
              queue_keepalive_s=args.queue_keepalive, grammars=grammar_compiler(runner, tok),
              drain=Drain("decode", args.drain_grace_s), coalesce=args.stream_coalesce == "on")
    made = []

    def add_service(server) -> None:
        if aio:
            from decode_svc.aio_server import AioDecodeServicer

            made.append(AioDecodeServicer(sched, args.worker_id, loop=server.loop, **kw))
        else:
            made.append(DecodeServicer(sched, args.worker_id, **kw))
        decode_pb2_grpc.add_DecodeServicer_to_server(made[0], server)

    name = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
    w.start_server(add_service, name, aio=aio)
    servicer = made[0]
    w.publish_and_serve()
    w.wait_for_signal()
    w.drain(servicer.drain, servicer.hand_back)
    w.shutdown(lambda: (sched.stop(), peers.close(), runner.close()))
    return 1 if w.fatal else 0
