"""``--device`` values: the accepted spellings, and a one-line error for a CUDA device this process
cannot use (instead of a torch traceback from ``torch.device`` / ``torch.cuda.set_device``).

Imports torch only inside :func:`check_device`, so CLI parsers can use :func:`device_spec` cheaply.
"""

from __future__ import annotations

import argparse
import re

_DEVICE_RE = re.compile(r"cpu|cuda(:\d+)?")


def device_spec(value: str) -> str:
    """argparse ``type`` of ``--device``: ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        argparse.ArgumentTypeError: any other string (argparse prints it naming the flag).
    """
    if not _DEVICE_RE.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not cpu, cuda or cuda:N")
    return value


def check_device(device: str) -> None:
    """A no-op for ``cpu``; for a CUDA device, check that this process can use it.

    Raises:
        SystemExit: one ``error: --device ...`` line (no traceback) when this torch has no CUDA or no
            GPU is visible, or the index is past the visible GPUs.
    """
    if not device.startswith("cuda"):
        return
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    idx = int(device.partition(":")[2] or 0)
    if n == 0:
        built = "built with CUDA" if torch.backends.cuda.is_built() else "a CPU-only build"
        raise SystemExit(f"error: --device {device}: no CUDA device is available (torch {torch.__version__}, "
                         f"{built})")
    if idx >= n:
        raise SystemExit(f"error: --device {device}: {n} CUDA device(s) visible (cuda:0..cuda:{n - 1})")
