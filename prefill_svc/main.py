"""`halfmoon serve-prefill`: a prefill worker (gRPC halfmoon.v1.Prefill + health + reflection + /metrics).

    halfmoon serve-prefill --model smollm2-135m-instruct --port 7001 --metrics-port 9401 \
        --registry 127.0.0.1:50050 --worker-id prefill-0 --page-size 16 --kv-memory-mb 512
"""

from __future__ import annotations

import argparse

from pd_common.worker_runtime import Worker, add_common_arguments, engine_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.engine_args import positive_float
    from pd_common.staged_writes import DEFAULT_STAGING_MB

    add_common_arguments(parser, "prefill")
    parser.add_argument("--kv-staging-mb", type=positive_float, default=float(DEFAULT_STAGING_MB),
                        help="per rank: the registered buffer a rank gathers a kv-head slice of the delta "
                             "pages into when it sends a decode rank only some of its heads (P and D split "
                             "the heads differently); at least two pages of the rank's heads; more than the rank's KV "
                             "pool is capped at the pool's size")


def run(args: argparse.Namespace) -> int:
    from engine.model_runner import ModelRunner
    from prefill_svc.scheduler import PrefillScheduler
    from pd_common.tokenizer import grammar_compiler, load_tokenizer
    from prefill_svc.server import PrefillServicer
    from pd_common.drain import Drain
    from protos import prefill_pb2, prefill_pb2_grpc

    w = Worker(args, "prefill")
    from pd_common.head_slices import PageShape
    from pd_common.staged_writes import RankWrites
    from prefill_svc.rank_writer import RankWriter

    runner = ModelRunner(engine_config(args, args.max_running_requests, args.disable_radix_cache),
                         follower=w.follower_spec())
    transfer = w.start_transfer(runner)
    shape = PageShape.from_layout(w.layout)
    try:
        staged = RankWrites(transfer, runner.kv_pool.region, w.rank_regions[0], shape,
                            int(args.kv_staging_mb * (1 << 20))) if runner.kv_pool.region is not None else None
    except ValueError as e:
        runner.close()
        raise SystemExit(f"error: --kv-staging-mb {args.kv_staging_mb:g}: {e}") from None
    sched = PrefillScheduler(runner, transfer, destination_timeout_s=args.destination_timeout,
                             transfer_log=args.transfer_log, checksums=args.kv_checksums,
                             disable_radix_cache=args.disable_radix_cache,
                             lease_valid_for=w.registry.lease_valid_for,
                             lease_fence_margin_s=args.lease_fence_margin, cpu_share=w.cpu_share,
                             rank_writer=RankWriter(transfer, runner.tp, w.rank_regions, shape, staged,
                                                    runner.kv_pool) if staged is not None else None)
    w.attach_kv_events(sched)
    sched.start()
    servicer = PrefillServicer(sched, transfer, args.worker_id, vocab_size=runner.vocab_size,
                               max_context=runner.max_context,
                               grammars=grammar_compiler(runner, load_tokenizer(runner, args.model)),
                               drain=Drain("prefill", args.drain_grace_s))
    name = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
    w.start_server(lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, s), name)
    w.publish_and_serve()
    w.wait_for_signal()
    w.drain(servicer.drain)
    w.shutdown(lambda: (sched.stop(), staged.close() if staged is not None else None, runner.close()))
    return 1 if w.fatal else 0
