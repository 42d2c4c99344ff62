"""Batches on the progress thread: posting them to UCX and driving each to a terminal state.

Completion: a batch posts its puts/gets (request handles released at once: UCP frees them on
completion), then one `ucp_ep_flush_nbx`; the batch is COMPLETED when that flush completes, which
UCX defines as remote completion of every earlier RMA on the endpoint. A notify to a peer waits
until every batch submitted before it to that peer is terminal, then goes out as an eager active
message, so the peer observes it only after those bytes are in place.

Failures: a UCX error status, or a request still pending at its batch's deadline, fails the batch
and closes its segment (every other batch queued on it fails too). For an owner on this host, a
batch counts as COMPLETED only if the owner process is still alive afterwards (transfer_svc.liveness
says why).

Metrics (sender side, WRITE batches only): halfmoon_transfer_bytes_total,
halfmoon_transfer_batch_seconds (submit -> remote completion), halfmoon_transfer_failures_total
{reason}. halfmoon_transfer_pages_total is counted by the caller (it knows what a page is).
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Sequence

from telemetry import metrics
from transfer_svc import ucp
from transfer_svc.batches import Batch, BatchTable
from transfer_svc.inbox import NOTIFY_AM_ID
from transfer_svc.liveness import owner_exited
from transfer_svc.progress import LoopWork, ProgressThread
from transfer_svc.segments import SegmentTable, SegmentWork
from transfer_svc.types import Op, RemoteRegion, Segment, State

# One UCX operation: (local addr, remote addr, nbytes, local memh, remote region)
RmaOp = tuple[int, int, int, int, RemoteRegion]

WRITE_DEADLINE_PASSED = "write deadline passed"


def put_delay_hook_s() -> float:
    """Test hook: env HALFMOON_TEST_PUT_DELAY_S, seconds the progress thread sleeps before posting
    each WRITE batch (so a test can stop the process in the middle of a multi-batch write). Never
    set it in production: the progress thread serves every batch and notify of the engine."""
    try:
        return float(os.environ.get("HALFMOON_TEST_PUT_DELAY_S", "0") or 0)
    except ValueError:
        return 0.0


def deadline_passed(b: Batch) -> bool:
    """Whether ``b`` carries a write deadline (``not_after``) that has passed."""
    return b.not_after is not None and time.monotonic() > b.not_after


def failure_label(reason: str, owner_gone: bool = False) -> str:
    """Map a failure reason to halfmoon_transfer_failures_total's `reason` label.

    ``owner_gone``: the segment's owner ran on this host and has exited (``owner_exited``). That
    fact decides the label whatever UCX said: a peer killed mid-batch is reported as a reset, an
    I/O error, an endpoint timeout or our own deadline depending on where the kill lands."""
    r = reason.lower()
    if owner_gone:
        return "peer_unreachable"
    if "timed out" in r or WRITE_DEADLINE_PASSED in r:
        return "timeout"
    if "closed by the user" in r or "engine closed" in r:
        return "aborted"
    if any(k in r for k in ("exited", "reset", "unreachable", "connection", "dropped",
                            "not connected", "endpoint timeout")):
        return "peer_unreachable"
    if "ucx" in r:
        return "remote_error"
    return "other"


class Inflight(LoopWork, SegmentWork):
    """Thread-side state of the batches: the ones waiting on a UCX request, and the transitions
    of every batch to COMPLETED or FAILED. All methods run on the progress thread."""

    def __init__(self, progress: ProgressThread, segments: SegmentTable, batches: BatchTable):
        self._progress = progress
        self._lib = progress.lib
        self._segments = segments
        self._batches = batches
        self._inflight: list[Batch] = []   # batches with an outstanding ucp request
        # reused request params
        self._rma_param = ucp.ucp_request_param_t()
        self._flush_param = ucp.ucp_request_param_t()
        self._am_param = ucp.ucp_request_param_t()
        self._am_param.op_attr_mask = ucp.UCP_OP_ATTR_FIELD_FLAGS
        self._am_param.flags = ucp.UCP_AM_SEND_FLAG_EAGER | ucp.UCP_AM_SEND_FLAG_COPY_HEADER

    # ------------------------------------------------------------------ posting
    def post_batch(self, b: Batch, ops: Sequence[RmaOp], op: Op) -> None:
        """Post every put (WRITE) or get (READ) of `b`, then the flush it completes with. A batch
        whose write deadline passed is refused here, the last moment before the puts."""
        seg = b.segment
        if op is Op.WRITE and put_delay_hook_s() > 0:
            time.sleep(put_delay_hook_s())
        if not seg.alive or not seg._ep:
            self.finish(b, State.FAILED, f"segment {seg.name!r} dropped: {seg.failure}")
            return
        if deadline_passed(b):
            self.finish(b, State.FAILED, WRITE_DEADLINE_PASSED)
            return
        lib = self._lib
        fn = lib.ucp_put_nbx if op is Op.WRITE else lib.ucp_get_nbx
        param = self._rma_param
        param.op_attr_mask = ucp.UCP_OP_ATTR_FIELD_MEMH
        pref = ctypes.byref(param)
        ep = seg._ep
        free = lib.ucp_request_free
        done = 0
        last = ucp.UCS_ERR_LAST + (1 << 64)
        for laddr, raddr, n, memh, rreg in ops:
            param.memh = memh
            req = fn(ep, laddr, n, raddr, rreg.rkey, pref)
            if not req:
                done += n
            elif req >= last:
                st = req - (1 << 64)
                self.finish(b, State.FAILED, f"UCX: {lib.status_string(st)} ({st})")
                self._segments.close(seg, f"batch {b.bid} failed to post", force=True)
                return
            else:
                free(req)
        b.done = done
        seg._pending.append(b)
        req = lib.ucp_ep_flush_nbx(seg._ep, ctypes.byref(self._flush_param))
        if self._track(b, seg, req, "UCX flush"):
            self._pump_notifies(seg)

    def queue_notify(self, b: Batch) -> None:
        """Queue notify `b` behind the last batch submitted to its segment (sent once that one is
        terminal; b.keep holds (header, payload))."""
        seg = b.segment
        if not seg.alive or not seg._ep:
            self.finish(b, State.FAILED, f"segment {seg.name!r} dropped: {seg.failure}")
            return
        b.after = seg._pending[-1] if seg._pending else None
        seg._notifies.append(b)
        self._pump_notifies(seg)

    def _pump_notifies(self, seg: Segment) -> None:
        """Send the segment's queued notifies whose preceding batch is terminal, in order."""
        while seg._notifies:
            b = seg._notifies[0]
            after = b.after
            if after is not None and after.state is State.PENDING:
                return
            # every batch before `after` finished no later than it: flush completion is ordered
            seg._notifies.popleft()
            if b.state is not State.PENDING:
                continue
            if after is not None and after.state is State.FAILED:
                self.finish(b, State.FAILED, f"earlier batch {after.bid} failed: {after.reason}")
                continue
            if deadline_passed(b):
                self.finish(b, State.FAILED, WRITE_DEADLINE_PASSED)
                continue
            header, payload = b.keep
            req = self._lib.ucp_am_send_nbx(seg._ep, NOTIFY_AM_ID, header, len(header), payload,
                                            len(payload), ctypes.byref(self._am_param))
            if not self._track(b, seg, req, "UCX am send"):
                return

    def _track(self, b: Batch, seg: Segment, req, what: str) -> bool:
        """Complete ``b`` or park it in flight by the status of the UCX request ``req`` it waits on;
        on an error fail it, close ``seg`` and return False."""
        st = ucp.ptr_status(req)
        if st == ucp.UCS_OK:
            self.finish(b, State.COMPLETED)
        elif st == ucp.UCS_INPROGRESS:
            b.request = req
            self._inflight.append(b)
        else:
            reason = f"{what}: {self._lib.status_string(st)} ({st})"
            self.finish(b, State.FAILED, reason)
            self._segments.close(seg, reason, force=True)
            return False
        return True

    # ------------------------------------------------------------------ LoopWork
    def has_inflight(self) -> bool:
        return bool(self._inflight)

    def soonest_deadline(self) -> float:
        return min(b.deadline for b in self._inflight)

    def check_inflight(self) -> None:
        """Finish batches whose request completed or whose deadline passed, then send the
        notifies that were waiting for them."""
        lib = self._lib
        now = time.monotonic()
        still = []
        for b in self._inflight:
            if b.state is not State.PENDING:
                continue
            st = lib.ucp_request_check_status(b.request)
            if st == ucp.UCS_INPROGRESS:
                if now > b.deadline:
                    self._progress.orphan(b.request)
                    b.request = 0
                    waited = now - b.deadline + self._batches.timeout_of(b)
                    reason = f"timed out after {waited:.1f}s"
                    self.finish(b, State.FAILED, reason)
                    if b.segment is not None:
                        self._segments.close(b.segment, f"batch {b.bid} {reason}", force=True)
                else:
                    still.append(b)
                continue
            lib.ucp_request_free(b.request)
            b.request = 0
            if st == ucp.UCS_OK:
                self.finish(b, State.COMPLETED)
            else:
                reason = f"UCX: {lib.status_string(st)} ({st})"
                self.finish(b, State.FAILED, reason)
                if b.segment is not None:
                    self._segments.close(b.segment, f"batch {b.bid} failed: {reason}", force=True)
        self._inflight = [b for b in still if b.state is State.PENDING]
        for seg in self._segments.open_segments():
            if seg._notifies:
                self._pump_notifies(seg)

    # ------------------------------------------------------------------ terminal states
    def finish(self, b: Batch, state: State, reason: str = "") -> None:
        """Move a PENDING batch to `state` (no-op if already terminal), count it, wake waiters."""
        if b.state is not State.PENDING:
            return
        seg = b.segment
        if state is State.COMPLETED and seg is not None and owner_exited(seg):
            reason = f"owner process {seg.local_pid} of segment {seg.name!r} exited"
            if b.kind == "write":
                metrics.TRANSFER_FAILURES.labels(reason="peer_unreachable").inc()
            b.state = State.FAILED
            b.reason = reason
            b.keep = None
            b.event.set()
            self._segments.close(seg, reason, force=True)
            return
        if state is State.COMPLETED:
            b.done = b.total
        if b.kind == "write":  # counted on the sender (telemetry/metrics.py, transfer group)
            if state is State.COMPLETED:
                metrics.TRANSFER_BYTES.inc(b.total)
                metrics.TRANSFER_BATCH_SECONDS.observe(time.monotonic() - b.started)
            else:
                gone = seg is not None and owner_exited(seg)
                metrics.TRANSFER_FAILURES.labels(reason=failure_label(reason, gone)).inc()
        b.reason = reason
        b.keep = None
        b.state = state
        b.event.set()
        if seg is not None:
            while seg._pending and seg._pending[0].state is not State.PENDING:
                seg._pending.popleft()

    def fail_segment(self, seg: Segment, reason: str) -> None:
        """SegmentWork: fail every batch and notify queued on `seg` (its requests orphaned)."""
        for b in list(seg._pending) + list(seg._notifies):
            if b.request:
                self._progress.orphan(b.request)
                b.request = 0
            self.finish(b, State.FAILED, reason)
        seg._pending.clear()
        seg._notifies.clear()
        self._inflight = [b for b in self._inflight if b.state is State.PENDING]

    def fail_all(self, reason: str) -> None:
        """Fail every batch still pending (engine closing)."""
        for b in list(self._inflight):
            if b.request:
                self._progress.orphan(b.request)
                b.request = 0
            self.finish(b, State.FAILED, reason)
        self._inflight = []
        for seg in self._segments.open_segments():
            for b in list(seg._pending) + list(seg._notifies):
                self.finish(b, State.FAILED, reason)
