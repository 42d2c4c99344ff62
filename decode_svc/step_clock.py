"""Where a decode step's wall time goes: the model (forward + sampling) vs host work.

The scheduler thread runs one decode step per iteration while requests run; the wall time from
one step's start to the next one's is the step as served. Of it, the time spent inside the model's
forward and sampling calls (on CUDA with the overlap schedule: launching them and waiting for the
tokens' copy) is ``device``; the rest is ``host``: per-request bookkeeping, streaming the tokens,
the inbox, and waiting for the GIL while the gRPC threads write. ``host`` / request-steps is the
host cost per running request per step (``bench.decode_host``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from telemetry import metrics as M


class StepClock:
    """Scheduler thread only. ``tick(batch)`` at each step's start; ``device()`` around model calls."""

    def __init__(self):
        self._start: float | None = None  # start of the step being timed, None when none ran
        self._batch = 0
        self._device = 0.0

    @contextmanager
    def device(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self._device += time.perf_counter() - t

    def tick(self, batch: int) -> None:
        """A step of ``batch`` running requests starts: the previous step (if the loop went
        straight on to this one) is counted, its wall time split into device and host."""
        now = time.perf_counter()
        if self._start is not None and self._batch:
            wall = now - self._start
            dev = min(self._device, wall)
            M.DECODE_STEP_SECONDS.labels(part="device").inc(dev)
            M.DECODE_STEP_SECONDS.labels(part="host").inc(wall - dev)
            M.DECODE_STEP_REQUESTS.inc(self._batch)
        self._start = now if batch else None
        self._batch = batch
        self._device = 0.0
