"""A worker's ``--cpu-share PATH``: its record in the share file of co-located CPU workers
(engine/cpu_share.py), opened at start-up before the model loads; the thread count it sets is the
role's ``halfmoon_<role>_torch_threads`` gauge."""

from __future__ import annotations

import argparse
import logging

from engine.cpu_share import CpuShare, CpuShareError, NoCpuShare
from telemetry import metrics as M

log = logging.getLogger("halfmoon.worker")


def add_cpu_share_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-share", default=None, metavar="PATH",
                        help="share file of the CPU workers on this machine (halfmoon up makes one): "
                             "while the other workers are idle this one computes on all cores, while "
                             "they are busy on its --torch-threads; needs --device cpu and --tp 1")


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
        share = CpuShare.open(args.cpu_share, args.torch_threads, on_threads=gauge.set)
    except CpuShareError as e:
        raise SystemExit(f"error: --cpu-share: {e}") from None
    log.info("cpu share: record %d of %d in %s; %d threads while others compute, up to %d cores",
             share.index, share.records, share.path, share.share, share.cores)
    return share
