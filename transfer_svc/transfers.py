"""The caller side of transfers and notifies: validate in the caller's thread, then post.

Everything that can be wrong with a request (types, bounds, sizes, a dropped segment) raises here,
before anything reaches UCX; what is posted runs on the progress thread (transfer_svc.inflight).
"""

from __future__ import annotations

from typing import Sequence

from transfer_svc.batches import Batch, BatchTable
from transfer_svc.inflight import Inflight, RmaOp
from transfer_svc.memory import LocalMemory
from transfer_svc.progress import ProgressThread
from transfer_svc.types import BoundsError, Op, Segment, SegmentClosed, State

NOTIFY_MAX_BYTES = 65536  # a notify goes out as one eager active message


def _check_alive(seg: Segment) -> None:
    if not seg.alive:
        raise SegmentClosed(f"segment {seg.name!r} was dropped ({seg.failure}); open it again")


class Transfers:
    """submit / send_notify. sender: this engine's segment name (the notify header)."""

    def __init__(self, progress: ProgressThread, memory: LocalMemory, batches: BatchTable,
                 inflight: Inflight, *, sender: str):
        self._progress = progress
        self._memory = memory
        self._batches = batches
        self._inflight = inflight
        self._sender = sender.encode()

    def _post(self, fn, b: Batch, *args) -> None:
        """Post fn(b, *args); should fn itself raise, the batch FAILS instead of hanging."""
        self._progress.post(fn, b, *args, on_error=lambda e: self._inflight.finish(
            b, State.FAILED, f"internal error: {e!r}"))

    def submit(self, seg: Segment, descs: Sequence[tuple[int, int, int]], op: Op = Op.WRITE, *,
               timeout_s: float | None = None, coalesce: bool = True,
               not_after: float | None = None) -> int:
        """One batch of (local addr, remote addr, nbytes) transfers -> batch id; see
        TransferEngine.submit. Raises TypeError, ValueError, BoundsError, SegmentClosed."""
        if not isinstance(seg, Segment):
            raise TypeError(f"submit needs a Segment from open_segment, got {type(seg).__name__}")
        _check_alive(seg)
        op = Op(op)
        ops = self._plan(seg, descs, coalesce)
        b = self._batches.new(seg, sum(o[2] for o in ops), timeout_s)
        b.nops = len(ops)
        b.kind = "write" if op is Op.WRITE else "read"
        b.not_after = not_after
        self._post(self._inflight.post_batch, b, ops, op)
        return b.bid

    def _plan(self, seg: Segment, descs: Sequence[tuple[int, int, int]],
              coalesce: bool) -> list[RmaOp]:
        """Bounds-check every descriptor and turn them into UCX operations; with `coalesce`, one
        that continues the previous one on both sides (same memh, same remote region) is merged."""
        ops: list[RmaOp] = []
        with self._memory.lookup() as find_local:
            for i, d in enumerate(descs):
                try:
                    laddr, raddr, n = (int(x) for x in d)
                except (TypeError, ValueError):
                    raise ValueError(f"descriptor {i}: expected (local addr, remote addr, nbytes), "
                                     f"got {d!r}") from None
                if n <= 0:
                    raise ValueError(f"descriptor {i}: nbytes must be > 0, got {n}")
                try:
                    lreg = find_local(laddr, n)
                    rreg = seg.find(raddr, n)
                except BoundsError as e:
                    raise BoundsError(f"descriptor {i}: {e}") from None
                if coalesce and ops:
                    pl, pr, pn, pm, prr = ops[-1]
                    if pl + pn == laddr and pr + pn == raddr and pm == lreg.memh and prr is rreg:
                        ops[-1] = (pl, pr, pn + n, pm, prr)
                        continue
                ops.append((laddr, raddr, n, lreg.memh, rreg))
        return ops

    def send_notify(self, seg: Segment, payload: bytes, *, timeout_s: float | None = None,
                    not_after: float | None = None) -> int:
        """Queue a notify of at most NOTIFY_MAX_BYTES -> id; see TransferEngine.send_notify.
        Raises TypeError, ValueError (too large), SegmentClosed."""
        if not isinstance(seg, Segment):
            raise TypeError(f"send_notify needs a Segment, got {type(seg).__name__}")
        payload = bytes(payload)
        if len(payload) > NOTIFY_MAX_BYTES:
            raise ValueError(f"notify payload is {len(payload)} bytes; the limit is "
                             f"{NOTIFY_MAX_BYTES}")
        _check_alive(seg)
        b = self._batches.new(seg, len(payload), timeout_s)
        b.kind = "notify"
        b.not_after = not_after
        b.keep = (self._sender, payload)
        self._post(self._inflight.queue_notify, b)
        return b.bid
