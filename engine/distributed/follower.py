"""A tensor-parallel follower rank (ranks 1..N-1): ``python -m engine.distributed.follower``.

Started by rank 0 (``TPGroup.launch``), never by hand. It builds its shard of the model and the KV
pool (``ModelRunner`` with its ``TPGroup``), then runs every batch rank 0 announces until rank 0
stops the group (exit 0) or goes away, or a collective fails (exit 1, one log line, no traceback).
A worker's follower program (``FollowerSpec``) calls :func:`run_follower` with a ``setup`` hook that
starts its own per-rank parts (``pd_common/tp_rank.py``: the rank's transfer engine).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

import torch

from engine.distributed.batch_wire import WireBatch

log = logging.getLogger("halfmoon.engine.tp")


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    """The flags ``TPGroup.launch`` passes every follower program."""
    p = argparse.ArgumentParser(prog=f"python -m {prog}")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--control-fd", type=int, required=True)
    p.add_argument("--reply-fd", type=int, default=None)
    p.add_argument("--config", required=True, help="the EngineConfig as JSON (EngineConfig.to_json)")
    p.add_argument("--agent-config", default="", help="the follower program's own settings (FollowerSpec)")
    return p.parse_args(argv)


def follow_step(runner, step: WireBatch) -> torch.Tensor:
    """Run one forward rank 0 announced, down the branch rank 0 took: replay the CUDA graph of
    ``step.graph_bucket`` (padded to it like rank 0's), or the eager model. Returns this rank's
    logits (empty ``[B, 0]``: only rank 0 gathers the vocabulary).

    Raises RuntimeError when rank 0 replays a graph this rank did not capture (the ranks' start-up
    differed: their collectives would no longer match).
    """
    if step.graph_bucket:
        graphs = runner.graph_runner
        if graphs is None or step.graph_bucket not in graphs.buckets:
            raise RuntimeError(f"rank 0 replays CUDA graph bucket {step.graph_bucket}; this rank captured "
                               f"{'none' if graphs is None else graphs.buckets}")
        return graphs.replay(step.batch, step.graph_bucket)
    return runner.model(step.batch, runner.backend, step.logit_index)


def run_follower(args: argparse.Namespace, setup: Callable | None = None) -> int:
    """Join the group, build this rank's runner, call ``setup(group, runner, args)`` (it may set
    ``group.on_command`` and return a ``close`` callable), then follow rank 0's batches. Returns the
    exit code."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{args.rank} %(levelname)s %(message)s")

    from engine.config import EngineConfig
    from engine.distributed.group import TPGroup
    from engine.model_runner import ModelRunner

    config = EngineConfig.from_json(args.config)
    config.apply_threads()
    close = None
    try:
        group = TPGroup.join(args.rank, args.size, args.store_port, args.control_fd, config.device,
                             config.tp_timeout_s, reply_fd=args.reply_fd)
        runner = ModelRunner(config, tp=group)
        if setup is not None:
            close = setup(group, runner, args)
    except (RuntimeError, ValueError, OSError) as e:
        log.error("tensor-parallel rank %d could not start: %s", args.rank, str(e).splitlines()[0])
        return 1
    code = 0
    try:
        with torch.inference_mode():
            while True:
                got = group.receive(runner.req_to_token_pool.req_to_token)
                if got is None:
                    break
                follow_step(runner, got)
    except RuntimeError as e:  # a peer died or a collective timed out
        log.error("tensor-parallel rank %d: collective failed, exiting: %s", args.rank, str(e).splitlines()[0])
        code = 1
    finally:
        if close is not None:
            close()
        group.close()
    return code


def main(argv: list[str] | None = None) -> int:
    return run_follower(parse_args(argv, "engine.distributed.follower"))


if __name__ == "__main__":
    sys.exit(main())
