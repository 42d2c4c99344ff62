"""A tensor-parallel follower rank (ranks 1..N-1): ``python -m engine.distributed.follower``.

Started by rank 0 (``TPGroup.launch``), never by hand. It builds its shard of the model and the KV
pool (``ModelRunner`` with its ``TPGroup``), then runs every batch rank 0 announces until rank 0
stops the group (exit 0) or goes away, or a collective fails (exit 1, one log line, no traceback).
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

log = logging.getLogger("halfmoon.engine.tp")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.distributed.follower")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--control-fd", type=int, required=True)
    p.add_argument("--config", required=True, help="the EngineConfig as JSON (EngineConfig.to_json)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{args.rank} %(levelname)s %(message)s")

    from engine.config import EngineConfig
    from engine.distributed.group import TPGroup
    from engine.model_runner import ModelRunner

    config = EngineConfig.from_json(args.config)
    config.apply_threads()
    try:
        group = TPGroup.join(args.rank, args.size, args.store_port, args.control_fd, config.device,
                             config.tp_timeout_s)
        runner = ModelRunner(config, tp=group)
    except (RuntimeError, ValueError) as e:
        log.error("tensor-parallel rank %d could not start: %s", args.rank, str(e).splitlines()[0])
        return 1
    code = 0
    try:
        with torch.inference_mode():
            while True:
                got = group.receive(runner.req_to_token_pool.req_to_token)
                if got is None:
                    break
                batch, logit_index = got
                runner.model(batch, runner.backend, logit_index)
    except RuntimeError as e:  # a peer died or a collective timed out
        log.error("tensor-parallel rank %d: collective failed, exiting: %s", args.rank, str(e).splitlines()[0])
        code = 1
    finally:
        group.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
