"""Transfer engine: one-sided RMA (UCX put/get) between registered memory of worker processes.

Mooncake-style API (after Mooncake's TransferEngine `registerLocalMemory` / `openSegment` /
`submitTransfer` / `getTransferStatus`):

    eng = TransferEngine("decode-0", transports="sm")
    region = eng.register_memory(ptr, nbytes, "cpu")          # owner side, once per pool buffer
    desc = eng.publish(kv_layout)                             # -> SegmentDescriptor (to the registry)
    seg = eng.open_segment(desc_or_name)                      # peer side
    bid = eng.submit(seg, [(local_addr, remote_addr, nbytes), ...], Op.WRITE)
    eng.wait(bid)  # or eng.status(bid) -> BatchStatus(state, bytes_done, bytes_total, reason)
    eng.send_notify(seg, b"room 7 done")                      # delivered after that batch's data
    eng.poll_notifies()                                       # -> [Notify(sender, payload)]

TransferEngine composes the layers below it, each a module of this package (lowest first):
types (records, errors), liveness (is a same-host owner alive), progress (the thread that owns
every UCP call), memory (local regions), inbox (received notifies), segments (descriptors,
endpoints, rkeys), batches (ids, status, wait), inflight (posting, completion, timeouts, notify
ordering) and transfers (caller-side validation of submit / send_notify).

error_mode "none" (the default) keeps UCX's shared-memory lanes and detects dead peers by batch
deadlines, UCX error statuses and the owner liveness check; "peer" uses UCX's keepalive and error
callback but loses the sm lanes (fine across hosts, where there are none). Measured with
bench/transfer.py, 64 MiB as 512 writes between two processes: NONE on sm 3.85 GB/s vs PEER
(UCX_TLS=sm,tcp) 0.97 GB/s on an idle 16-core host, 1.97 vs 0.17 GB/s on a loaded 2-core one.
"""

from __future__ import annotations

import os
import threading
import uuid
from typing import Sequence

from protos import registry_pb2
from transfer_svc import ucp
from transfer_svc.batches import BatchTable
from transfer_svc.inbox import NOTIFY_AM_ID, NotifyInbox
from transfer_svc.inflight import WRITE_DEADLINE_PASSED, Inflight
from transfer_svc.liveness import host_id, pid_start_ticks
from transfer_svc.memory import LocalMemory
from transfer_svc.progress import ProgressThread, WorkerConfig
from transfer_svc.segments import Identity, Resolver, SegmentTable
from transfer_svc.transfers import Transfers
from transfer_svc.types import (BatchStatus, BoundsError, DescriptorError, Notify, Op, Region,
                                Segment, SegmentClosed, State, TransferError)
from transfer_svc.ucp import UCXError

__all__ = ["TransferEngine", "Op", "State", "BatchStatus", "Notify", "Region", "Segment",
           "TransferError", "SegmentClosed", "DescriptorError", "BoundsError", "UCXError",
           "NOTIFY_AM_ID", "WRITE_DEADLINE_PASSED", "host_id", "pid_start_ticks"]


class _Setting:
    """An engine attribute that one of its layers keeps: reads and writes go to that layer's
    attribute of the same name, so a change (say, `eng.resolver = client`) reaches where it is
    used."""

    def __init__(self, layer: str, doc: str):
        self.layer = layer
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        return getattr(getattr(obj, self.layer), self.name)

    def __set__(self, obj, value) -> None:
        setattr(getattr(obj, self.layer), self.name, value)


def _default_name() -> str:
    return f"seg-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class TransferEngine:
    """A UCP context + worker + progress thread; see the module docstring.

    Args:
        name: segment name published for this engine (= worker id); default a random one.
        transports: UCX_TLS for this engine ("sm", "tcp", "cuda_copy,cuda_ipc,tcp", ...). None leaves
            UCX's own choice (environment `UCX_TLS` or all transports).
        timeout_s: default deadline of a batch, seconds; a batch still pending then FAILS and its
            segment is dropped.
        error_mode: "none" (default, keeps sm lanes, timeouts detect dead peers) or "peer".
        libucp: path of another libucp.so (default: env HALFMOON_LIBUCP, else the libucx wheel).
        resolver: looks segment names up for open_segment(name): an object with
            `get_segment(name, refresh=False) -> SegmentDescriptor` (KeyError if unknown) and
            `invalidate(name)`, i.e. a RegistryClient.
        spin_s: how long the progress thread keeps polling after activity before sleeping, seconds.
        busy_poll: keep polling (no sleep) while batches are in flight. Off by default: on a small
            shared machine the spinning thread takes CPU from the peer (measured slower on 2 cores).
        tcp_sockbuf: UCX_TCP_SNDBUF / UCX_TCP_RCVBUF unless set in the environment.

    Raises ValueError for a bad error_mode or timeout_s, UCXError if UCX cannot start.
    """

    # settings, kept by the layer that uses them (assignable, as plain attributes would be)
    worker_address = _Setting("_progress", "this engine's UCP worker address (in its descriptor)")
    timeout_s = _Setting("_batches", "default batch timeout, seconds")
    resolver = _Setting("_segments", "looks names up for open_segment(name)")
    error_mode = _Setting("_segments", "UCX error-handling mode of new endpoints")
    spin_s = _Setting("_progress", "seconds of polling after activity before sleeping")
    busy_poll = _Setting("_progress", "poll without sleeping while batches are in flight")

    def __init__(self, name: str | None = None, *, transports: str | None = None,
                 timeout_s: float = 10.0, error_mode: str = "none", libucp: str | None = None,
                 resolver: Resolver | None = None,
                 spin_s: float = 0.0005, busy_poll: bool = False, tcp_sockbuf: str = "8m"):
        if error_mode not in ("none", "peer"):
            raise ValueError(f"error_mode must be 'none' or 'peer', got {error_mode!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.name = name or _default_name()
        self.incarnation = uuid.uuid4().hex
        self._progress = ProgressThread(ucp.load(libucp),
                                        WorkerConfig(self.name, transports, tcp_sockbuf),
                                        spin_s=spin_s, busy_poll=busy_poll)
        self._memory = LocalMemory(self._progress)
        self._inbox = NotifyInbox()
        self._segments = SegmentTable(self._progress, self._memory,
                                      Identity(self.name, self.incarnation, host_id()),
                                      error_mode=error_mode, resolver=resolver)
        self._batches = BatchTable(float(timeout_s))
        self._inflight = Inflight(self._progress, self._segments, self._batches)
        self._segments.bind(self._inflight)
        self._transfers = Transfers(self._progress, self._memory, self._batches, self._inflight,
                                    sender=self.name)
        self._progress.start(self._inflight, self._teardown, {NOTIFY_AM_ID: self._inbox.deliver})
        self._thread: threading.Thread = self._progress.thread  # its native_id: CPU accounting

    def _teardown(self) -> None:
        """Progress thread, once the loop stopped: fail what is pending, close every endpoint,
        give their requests 2 s to complete, unmap memory."""
        self._inflight.fail_all("engine closed")
        self._segments.close_all("engine closed")
        self._progress.drain_orphans(2.0)
        self._memory.unmap_all()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Fail pending batches, close endpoints, unmap memory, stop the progress thread."""
        self._progress.close()

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ memory
    def register_memory(self, ptr: int, length: int, location: str = "cpu") -> Region:
        """Register [ptr, ptr + length) bytes for RMA; location "cpu" or "cuda[:N]" (CUDA memory via
        UCS_MEMORY_TYPE_CUDA). Regions of one engine must not overlap. Raises ValueError on bad
        arguments, UCXError if UCX refuses the mapping."""
        return self._memory.register(ptr, length, location)

    def unregister_memory(self, region: Region) -> None:
        """Unmap a region (peers that still write into it get errors; unpublish first)."""
        self._memory.unregister(region)

    def regions(self) -> list[Region]:
        return self._memory.regions()

    # ------------------------------------------------------------------ segments
    def publish(self, kv_layout: registry_pb2.KVLayout | None = None
                ) -> registry_pb2.SegmentDescriptor:
        """This engine's segment descriptor: name, incarnation, UCP worker address, every registered
        region with its packed rkey, and the owner's KV layout. Register it with the registry
        (RegistryClient.publish) so peers can open it."""
        return self._segments.publish(kv_layout)

    def open_segment(self, target: str | registry_pb2.SegmentDescriptor,
                     incarnation: str | None = None) -> Segment:
        """Open (connect to) a peer's segment, from its descriptor or its name (through `resolver`).

        Reuses the open handle when the descriptor's incarnation is unchanged; a new incarnation
        (peer restarted) drops the old handle first. With a name, `incarnation` (when the caller
        knows which one it wants, e.g. from a KVDestination) forces a registry lookup if the cached
        descriptor is another one. Raises DescriptorError for malformed descriptors, KeyError for
        an unknown name, SegmentClosed when the owner process on this host is gone, UCXError when
        UCX cannot reach the peer."""
        return self._segments.open(target, incarnation)

    def close_segment(self, seg: Segment) -> None:
        """Drop a segment handle (pending batches to it FAIL)."""
        if not self._progress.closed:
            self._progress.call(self._segments.close, seg, "closed by the user", False)

    def segments(self) -> dict[str, Segment]:
        return self._segments.snapshot()

    # ------------------------------------------------------------------ transfers
    def submit(self, seg: Segment, descs: Sequence[tuple[int, int, int]], op: Op = Op.WRITE, *,
               timeout_s: float | None = None, coalesce: bool = True,
               not_after: float | None = None) -> int:
        """Submit one asynchronous batch of (local addr, remote addr, nbytes) transfers -> batch id.

        op WRITE puts local -> remote, READ gets remote -> local. Every local range must lie in one
        registered region and every remote range in one region of `seg`'s descriptor; otherwise
        BoundsError is raised and nothing is posted. With `coalesce`, descriptors that continue the
        previous one on both sides are merged (fewer, larger UCX ops). Raises SegmentClosed when the
        handle was dropped. Never blocks on the network.

        `not_after` (time.monotonic() seconds) fences the writer: the progress thread checks it
        right before posting the first put, and a batch not posted by then FAILS with "write
        deadline passed" without touching the peer's memory (docs/architecture.md, Fencing
        one-sided writes)."""
        return self._transfers.submit(seg, descs, op, timeout_s=timeout_s, coalesce=coalesce,
                                      not_after=not_after)

    def status(self, bid: int) -> BatchStatus:
        """PENDING / COMPLETED / FAILED(reason) of a batch (or a notify), with bytes done."""
        return self._batches.status(bid)

    def wait(self, bid: int, timeout_s: float | None = None) -> BatchStatus:
        """Block until the batch is terminal (or timeout_s passes) and return its status. The
        batch's own deadline bounds the wait when timeout_s is None."""
        return self._batches.wait(bid, timeout_s)

    def release(self, bid: int) -> None:
        """Forget a terminal batch id (optional; old terminal batches are pruned anyway)."""
        self._batches.release(bid)

    # ------------------------------------------------------------------ notifies
    def send_notify(self, seg: Segment, payload: bytes, *, timeout_s: float | None = None,
                    not_after: float | None = None) -> int:
        """Send a small message to `seg`'s owner -> id (status/wait like a batch). It is sent only
        after every batch submitted earlier to that segment COMPLETED (UCX flush = remote
        completion), so the peer sees it after those bytes are in place; if one of them FAILED the
        notify FAILS too and is not sent. payload: bytes, at most 64 KiB (eager AM). `not_after`:
        as for submit, checked right before the message goes out."""
        return self._transfers.send_notify(seg, payload, timeout_s=timeout_s, not_after=not_after)

    def poll_notifies(self) -> list[Notify]:
        """Notifies received since the last call, in arrival order (never blocks)."""
        return self._inbox.poll()

    def wait_notify(self, timeout_s: float) -> list[Notify]:
        """poll_notifies, first waiting up to timeout_s seconds for at least one."""
        return self._inbox.wait(timeout_s)
