"""A worker's ``--cpu-share PATH``: its record in the share file of co-located CPU workers
(engine/cpu_share.py), opened at start-up before the model loads; the thread count it sets is the
role's ``halfmoon_<role>_torch_threads`` gauge."""

from __future__ import annotations

import argparse
import logging

from engine.cpu_share import WORKER_MIN_IDLE, CpuShare, CpuShareError, NoCpuShare
from telemetry import metrics as M

log = logging.getLogger("halfmoon.worker")


def add_cpu_share_argument(parser: argparse.ArgumentParser) -> None:
    """``--cpu-share`` and ``--cpu-share-min-idle`` (default engine.cpu_share's WORKER_MIN_IDLE, where
    the measurements are)."""
    min_idle = WORKER_MIN_IDLE
    parser.add_argument("--cpu-share", default=None, metavar="PATH",
                        help="share file of the CPU workers on this machine (halfmoon up makes one): "
                             "while the other workers are idle this one computes on all cores, while "
                             "they are busy on its --torch-threads; needs --device cpu and --tp 1")
    parser.add_argument("--cpu-share-min-idle", type=share_of_core, default=min_idle, metavar="F",
                        help="with --cpu-share: a thread beyond --torch-threads needs a core that every "
                             "other process (router, clients, ...) left at least this share of idle over "
                             f"the last 0.2 s; 0 = the share file alone decides (default {min_idle:g})")


def share_of_core(text: str) -> float:
    """argparse type: a float in [0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return v


def open_cpu_share(args, role: str) -> CpuShare | NoCpuShare:
    """This worker's share (``NoCpuShare`` without the flag).

    Raises:
        SystemExit: one ``error: --cpu-share: ...`` line (not a CPU worker of one rank, or a file
            that is missing, not a share file or has no free record).
    """
    gauge = M.PREFILL_TORCH_THREADS if role == "prefill" else M.DECODE_TORCH_THREADS
    if args.cpu_share is None:
        gauge.set(args.torch_threads)
        return NoCpuShare()
    if args.device != "cpu" or args.tp != 1:
        raise SystemExit(f"error: --cpu-share: needs --device cpu and --tp 1 (got --device {args.device} "
                         f"--tp {args.tp})")
    if args.torch_threads < 1:
        raise SystemExit(f"error: --cpu-share: needs --torch-threads >= 1, got {args.torch_threads}")
    try:
        share = CpuShare.open(args.cpu_share, args.torch_threads, on_threads=gauge.set,
                              min_idle=args.cpu_share_min_idle)
    except CpuShareError as e:
        raise SystemExit(f"error: --cpu-share: {e}") from None
    log.info("cpu share: record %d of %d in %s; %d threads while others compute, up to %d cores "
             "(idle ones: --cpu-share-min-idle %g)", share.index, share.records, share.path, share.share,
             share.cores, args.cpu_share_min_idle)
    return share
