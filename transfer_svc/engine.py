"""Transfer engine: one-sided RMA (UCX put/get) between registered memory of worker processes.

Mooncake-style API (DESIGN.md §5; after Mooncake's TransferEngine `registerLocalMemory` /
`openSegment` / `submitTransfer` / `getTransferStatus`):

    eng = TransferEngine("decode-0", transports="sm")
    region = eng.register_memory(ptr, nbytes, "cpu")          # owner side, once per pool buffer
    desc = eng.publish(kv_layout)                             # -> SegmentDescriptor (to the registry)
    seg = eng.open_segment(desc_or_name)                      # peer side
    bid = eng.submit(seg, [(local_addr, remote_addr, nbytes), ...], Op.WRITE)
    eng.wait(bid)  # or eng.status(bid) -> BatchStatus(state, bytes_done, bytes_total, reason)
    eng.send_notify(seg, b"room 7 done")                      # delivered after that batch's data
    eng.poll_notifies()                                       # -> [Notify(sender, payload)]

Threading (the only design that keeps UCP single-threaded): a progress thread owns the UCP context,
worker and every UCP call. Callers validate their arguments in their own thread (bounds checks raise
before UCX sees anything), then enqueue a closure and wake the thread through an eventfd. When idle,
the thread sleeps in poll() on the worker's event fd (armed with `ucp_worker_arm`; UCS_ERR_BUSY means
"progress again first") and the eventfd, so an idle engine burns no CPU; it keeps progressing while
work is pending, which also makes it a progressing *target* for tcp peers.

Completion: each batch posts its puts/gets (handles released at once: UCP frees them on completion)
then one `ucp_ep_flush_nbx`; the batch is COMPLETED when that flush completes, which UCX defines as
remote completion of every earlier RMA on the endpoint. A notify to a peer waits until every batch
submitted before it to that peer is terminal, then goes out as an eager active message: it is
observed by the peer only after those bytes are in place.

Failures: endpoints use error-handling mode NONE by default, because mode PEER makes UCX drop the
shared-memory lanes (FACTS.md: everything then goes over tcp loopback at ~0.45 GB/s). Dead peers are
detected by a per-batch deadline (`timeout_s`) and by error statuses UCX returns; either turns every
pending batch of that segment into FAILED, force-closes the endpoint and drops the handle (later
`submit` on it raises `SegmentClosed`; `open_segment(name)` fetches a fresh descriptor).
`error_mode="peer"` selects UCX's own peer-failure detection (keepalive, error callback) at the price
of the sm lanes (useful across hosts, where no sm lane exists anyway); measured with bench/transfer.py,
64 MiB as 512 writes between two processes: NONE on sm 3.85 GB/s vs PEER (UCX_TLS=sm,tcp) 0.97 GB/s
on an idle 16-core host, 1.97 vs 0.17 GB/s on the loaded 2-core box (bench/results/). Shared-memory (cma) writes
into a process that died report success, so for an owner on the same host (descriptor host_id) a
batch counts as COMPLETED only if the owner's pid (with its start time) is still alive afterwards.

Metrics (telemetry/metrics.py, sender side, WRITE batches only): halfmoon_transfer_bytes_total,
halfmoon_transfer_batch_seconds (submit -> remote completion), halfmoon_transfer_failures_total
{reason}. halfmoon_transfer_pages_total is counted by the caller (it knows what a page is).
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import enum
import logging
import os
import select
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

from telemetry import metrics
from protos import registry_pb2
from transfer_svc import ucp
from transfer_svc.digest import descriptor_digest
from transfer_svc.ucp import UCXError

log = logging.getLogger(__name__)

NOTIFY_AM_ID = 17
_MAX_KEPT_BATCHES = 100_000


class Op(enum.IntEnum):
    WRITE = 0  # local -> remote (put)
    READ = 1   # remote -> local (get)


class State(enum.Enum):
    PENDING = "PENDING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"


@dataclass(frozen=True)
class BatchStatus:
    """Status of one submitted batch. bytes_done: bytes known complete (all of them once COMPLETED;
    while PENDING, those whose puts UCX completed in place); reason: why it FAILED."""

    state: State
    bytes_done: int
    bytes_total: int
    reason: str = ""


@dataclass(frozen=True)
class Notify:
    sender: str      # segment name of the sending engine
    payload: bytes


class TransferError(RuntimeError):
    """Base class of the engine's errors."""


class SegmentClosed(TransferError):
    """The segment handle was dropped (peer failed, new incarnation, or closed): open it again."""


class DescriptorError(TransferError, ValueError):
    """A segment descriptor is malformed (empty address, bad rkey, overlapping regions, ...)."""


class BoundsError(TransferError, ValueError):
    """A transfer descriptor falls outside every registered (local) or published (remote) region."""


@dataclass
class Region:
    """A registered local memory region. base/length in bytes; location "cpu" or "cuda:N"."""

    base: int
    length: int
    location: str
    memh: int = 0
    rkey: bytes = b""


@dataclass
class _RemoteRegion:
    base: int
    length: int
    rkey_buf: bytes
    rkey: int = 0  # ucp_rkey_h, unpacked on the progress thread


@dataclass
class Segment:
    """An opened remote segment (a peer's registered memory). Use it with submit / send_notify."""

    name: str
    incarnation: str
    descriptor: registry_pb2.SegmentDescriptor
    kv_layout: registry_pb2.KVLayout
    _regions: list[_RemoteRegion] = field(default_factory=list, repr=False)
    _bases: list[int] = field(default_factory=list, repr=False)
    _ep: int = field(default=0, repr=False)
    alive: bool = True
    failure: str = ""
    local_pid: int = 0          # owner's pid when it runs on this host (liveness check), else 0
    local_start: int = 0
    _pending: collections.deque = field(default_factory=collections.deque, repr=False)  # batches
    _notifies: collections.deque = field(default_factory=collections.deque, repr=False)

    def find(self, addr: int, n: int) -> _RemoteRegion:
        i = bisect.bisect_right(self._bases, addr) - 1
        if i >= 0:
            r = self._regions[i]
            if addr + n <= r.base + r.length:
                return r
        raise BoundsError(f"remote range [{addr:#x}, +{n}) is outside every region published by "
                          f"segment {self.name!r}")


@dataclass
class _Batch:
    bid: int
    segment: Segment | None
    total: int
    deadline: float
    state: State = State.PENDING
    done: int = 0
    reason: str = ""
    kind: str = "write"  # "write" | "read" | "notify"
    started: float = 0.0
    timeout: float = 0.0   # seconds from submit to deadline
    nops: int = 0          # UCX operations posted (after coalescing)
    after: "_Batch | None" = None  # notify only: the last batch to its segment before it
    request: int = 0   # pending ucp request (flush or am send)
    keep: object = None  # buffers that must outlive the request
    event: threading.Event = field(default_factory=threading.Event)


def host_id() -> str:
    """"<hostname>/<kernel boot id>": equal for two processes on one (booted) host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{os.uname().nodename}/{boot}"


def pid_start_ticks(pid: int) -> int | None:
    """starttime of a live process from /proc/<pid>/stat (clock ticks), None if it is gone or a
    zombie (a process killed but not yet reaped no longer has its memory)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rindex(b")") + 2:].split()
    if rest[0] in (b"Z", b"X"):
        return None
    return int(rest[19])


def _failure_label(reason: str) -> str:
    """Map a failure reason to halfmoon_transfer_failures_total's `reason` label."""
    r = reason.lower()
    if "timed out" in r:
        return "timeout"
    if "closed by the user" in r or "engine closed" in r:
        return "aborted"
    if any(k in r for k in ("exited", "reset", "unreachable", "connection", "dropped")):
        return "peer_unreachable"
    if "ucx" in r:
        return "remote_error"
    return "other"


def _cuda_context_current(location: str) -> None:
    """Make the device's primary CUDA context current in the calling (progress) thread: UCX's cuda
    transports query and copy CUDA memory through the thread's current context."""
    import torch

    torch.cuda.set_device(int(location.split(":", 1)[1]) if ":" in location else 0)


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
    """

    def __init__(self, name: str | None = None, *, transports: str | None = None,
                 timeout_s: float = 10.0, error_mode: str = "none", libucp: str | None = None,
                 resolver=None,
                 spin_s: float = 0.0005, busy_poll: bool = False, tcp_sockbuf: str = "8m"):
        if error_mode not in ("none", "peer"):
            raise ValueError(f"error_mode must be 'none' or 'peer', got {error_mode!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.name = name or _default_name()
        self.incarnation = uuid.uuid4().hex
        self.timeout_s = float(timeout_s)
        self.error_mode = error_mode
        self.resolver = resolver
        self.spin_s = spin_s
        self.busy_poll = busy_poll
        self._lib = ucp.load(libucp)
        self._host_id = host_id()
        self._regions: list[Region] = []
        self._region_bases: list[int] = []
        self._segments: dict[str, Segment] = {}
        self._batches: collections.OrderedDict[int, _Batch] = collections.OrderedDict()
        self._next_bid = 1
        self._lock = threading.Lock()   # guards _batches, _next_bid, _segments, _regions (caller side)
        # one open at a time: two racing opens of the same peer would make two endpoints, and
        # batches/notifies on the one that loses the race would be orphaned
        self._open_lock = threading.Lock()
        self._cmds: collections.deque = collections.deque()
        self._inflight: list[_Batch] = []   # batches with an outstanding ucp request (thread-owned)
        self._orphans: list[int] = []        # requests of failed batches, freed when they complete
        self._notifies: collections.deque[Notify] = collections.deque()
        self._notify_event = threading.Event()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._stop = False
        self._closed = False
        self._ep_err_cb = ucp.ERR_HANDLER_CB(self._on_ep_error)
        self._am_cb = ucp.AM_RECV_CB(self._on_am)
        self._ep_ids: dict[int, Segment] = {}
        self._dropped: dict[str, str] = {}  # segment name -> incarnation of its last failed handle
        self._ctx = ctypes.c_void_p()
        self._worker = ctypes.c_void_p()
        self.worker_address = b""
        started = Future()
        self._thread = threading.Thread(target=self._run, args=(transports, tcp_sockbuf, started),
                                        name=f"ucx-progress-{self.name}", daemon=True)
        self._thread.start()
        started.result()

    # ------------------------------------------------------------------ setup / teardown (thread)
    def _setup(self, transports: str | None, tcp_sockbuf: str) -> None:
        lib = self._lib
        config = ctypes.c_void_p()
        lib.check(lib.ucp_config_read(None, None, ctypes.byref(config)), "ucp_config_read")
        try:
            if transports:
                lib.check(lib.ucp_config_modify(config, b"TLS", transports.encode()), "UCX_TLS")
            for key in ("TCP_SNDBUF", "TCP_RCVBUF"):
                if f"UCX_{key}" not in os.environ and tcp_sockbuf:
                    lib.check(lib.ucp_config_modify(config, key.encode(), tcp_sockbuf.encode()), key)
            params = ucp.ucp_params_t()
            params.field_mask = ucp.UCP_PARAM_FIELD_FEATURES | ucp.UCP_PARAM_FIELD_NAME
            params.features = ucp.UCP_FEATURE_RMA | ucp.UCP_FEATURE_AM | ucp.UCP_FEATURE_WAKEUP
            params.name = self.name.encode()
            lib.check(lib.ucp_init_version(1, 22, ctypes.byref(params), config,
                                           ctypes.byref(self._ctx)), "ucp_init")
        finally:
            lib.ucp_config_release(config)
        wp = ucp.ucp_worker_params_t()
        wp.field_mask = ucp.UCP_WORKER_PARAM_FIELD_THREAD_MODE
        wp.thread_mode = ucp.UCS_THREAD_MODE_SINGLE
        lib.check(lib.ucp_worker_create(self._ctx, ctypes.byref(wp), ctypes.byref(self._worker)),
                  "ucp_worker_create")
        addr, alen = ctypes.c_void_p(), ctypes.c_size_t()
        lib.check(lib.ucp_worker_get_address(self._worker, ctypes.byref(addr), ctypes.byref(alen)),
                  "ucp_worker_get_address")
        self.worker_address = ctypes.string_at(addr, alen.value)
        lib.ucp_worker_release_address(self._worker, addr)
        efd = ctypes.c_int()
        lib.check(lib.ucp_worker_get_efd(self._worker, ctypes.byref(efd)), "ucp_worker_get_efd")
        self._efd = efd.value
        hp = ucp.ucp_am_handler_param_t()
        hp.field_mask = (ucp.UCP_AM_HANDLER_PARAM_FIELD_ID | ucp.UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                         | ucp.UCP_AM_HANDLER_PARAM_FIELD_CB)
        hp.id = NOTIFY_AM_ID
        hp.flags = ucp.UCP_AM_FLAG_WHOLE_MSG
        hp.cb = ctypes.cast(self._am_cb, ctypes.c_void_p)
        lib.check(lib.ucp_worker_set_am_recv_handler(self._worker, ctypes.byref(hp)),
                  "ucp_worker_set_am_recv_handler")
        # Reused request params (thread-owned).
        self._rma_param = ucp.ucp_request_param_t()
        self._flush_param = ucp.ucp_request_param_t()
        self._am_param = ucp.ucp_request_param_t()
        self._am_param.op_attr_mask = ucp.UCP_OP_ATTR_FIELD_FLAGS
        self._am_param.flags = ucp.UCP_AM_SEND_FLAG_EAGER | ucp.UCP_AM_SEND_FLAG_COPY_HEADER

    def _teardown(self) -> None:
        lib = self._lib
        for seg in list(self._segments.values()):
            self._close_segment(seg, "engine closed", force=False)
        deadline = time.monotonic() + 2.0
        while self._orphans and time.monotonic() < deadline:
            lib.ucp_worker_progress(self._worker)
            self._reap_orphans()
        for r in self._regions:
            lib.ucp_mem_unmap(self._ctx, r.memh)
        self._regions.clear()
        lib.ucp_worker_destroy(self._worker)
        lib.ucp_cleanup(self._ctx)

    def close(self) -> None:
        """Fail pending batches, close endpoints, unmap memory, stop the progress thread."""
        if self._closed:
            return
        self._closed = True
        self._stop = True
        self._wake()
        self._thread.join(timeout=10)
        os.close(self._wake_fd)

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ progress thread
    def _wake(self) -> None:
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:
            pass

    def _call(self, fn: Callable, *args):
        """Run fn(*args) on the progress thread and return its result (or raise its exception)."""
        if self._closed:
            raise TransferError("engine is closed")
        fut: Future = Future()
        self._cmds.append((fn, args, fut))
        self._wake()
        return fut.result()

    def _post(self, fn: Callable, *args) -> None:
        if self._closed:
            raise TransferError("engine is closed")
        self._cmds.append((fn, args, None))
        self._wake()

    def _run(self, transports, tcp_sockbuf, started: Future) -> None:
        try:
            self._setup(transports, tcp_sockbuf)
        except BaseException as e:  # noqa: BLE001 - reported to the constructor
            started.set_exception(e)
            return
        started.set_result(None)
        lib, worker = self._lib, self._worker
        poller = select.poll()
        poller.register(self._efd, select.POLLIN)
        poller.register(self._wake_fd, select.POLLIN)
        last_activity = time.monotonic()
        while True:
            busy = False
            while self._cmds:
                fn, args, fut = self._cmds.popleft()
                try:
                    res = fn(*args)
                    if fut is not None:
                        fut.set_result(res)
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    if fut is not None:
                        fut.set_exception(e)
                    else:
                        log.exception("transfer engine: posted work failed")
                        if args and isinstance(args[0], _Batch):
                            self._finish(args[0], State.FAILED, f"internal error: {e!r}")
                busy = True
            if self._stop:
                break
            while lib.ucp_worker_progress(worker):
                busy = True
            try:
                if self._inflight:
                    self._check_inflight()
                if self._orphans:
                    self._reap_orphans()
            except Exception:  # noqa: BLE001 - keep the progress thread alive
                log.exception("transfer engine: completion check failed")
            now = time.monotonic()
            if busy:
                last_activity = now
                continue
            if self._cmds or now - last_activity < self.spin_s or (self._inflight and self.busy_poll):
                continue
            st = lib.ucp_worker_arm(worker)
            if st == ucp.UCS_ERR_BUSY:
                continue
            if self._inflight or self._orphans:
                soonest = min((b.deadline for b in self._inflight), default=now + 0.05)
                timeout_ms = max(0, min(50, int((soonest - now) * 1000) + 1))
            else:
                timeout_ms = 1000
            for fd, _ in poller.poll(timeout_ms):
                if fd == self._wake_fd:
                    try:
                        os.eventfd_read(self._wake_fd)
                    except BlockingIOError:
                        pass
        try:
            self._fail_all("engine closed")
            self._teardown()
        finally:
            # release callers waiting on commands queued after stop
            while self._cmds:
                _, _, fut = self._cmds.popleft()
                if fut is not None:
                    fut.set_exception(TransferError("engine is closed"))

    def _check_inflight(self) -> None:
        lib = self._lib
        now = time.monotonic()
        still = []
        for b in self._inflight:
            if b.state is not State.PENDING:
                continue
            st = lib.ucp_request_check_status(b.request)
            if st == ucp.UCS_INPROGRESS:
                if now > b.deadline:
                    self._orphans.append(b.request)
                    b.request = 0
                    reason = f"timed out after {now - b.deadline + self._timeout_of(b):.1f}s"
                    self._finish(b, State.FAILED, reason)
                    if b.segment is not None:
                        self._close_segment(b.segment, f"batch {b.bid} {reason}", force=True)
                else:
                    still.append(b)
                continue
            lib.ucp_request_free(b.request)
            b.request = 0
            if st == ucp.UCS_OK:
                self._finish(b, State.COMPLETED)
            else:
                reason = f"UCX: {lib.status_string(st)} ({st})"
                self._finish(b, State.FAILED, reason)
                if b.segment is not None:
                    self._close_segment(b.segment, f"batch {b.bid} failed: {reason}", force=True)
        self._inflight = [b for b in still if b.state is State.PENDING]
        self._pump_notifies_all()

    def _timeout_of(self, b: _Batch) -> float:
        return b.timeout or self.timeout_s

    def _reap_orphans(self) -> None:
        keep = []
        for req in self._orphans:
            if self._lib.ucp_request_check_status(req) == ucp.UCS_INPROGRESS:
                keep.append(req)
            else:
                self._lib.ucp_request_free(req)
        self._orphans = keep

    def _finish(self, b: _Batch, state: State, reason: str = "") -> None:
        if b.state is not State.PENDING:
            return
        seg = b.segment
        if state is State.COMPLETED and seg is not None and seg.local_pid:
            # Shared-memory (cma) writes into a process that died report success: a batch counts as
            # complete only if the owner was still alive after its last byte landed.
            if pid_start_ticks(seg.local_pid) != seg.local_start:
                state, reason = State.FAILED, f"owner process {seg.local_pid} of segment " \
                                              f"{seg.name!r} exited"
                if b.kind == "write":
                    metrics.TRANSFER_FAILURES.labels(reason="peer_unreachable").inc()
                b.state = State.FAILED
                b.reason = reason
                b.keep = None
                b.event.set()
                self._close_segment(seg, reason, force=True)
                return
        if state is State.COMPLETED:
            b.done = b.total
        if b.kind == "write":  # counted on the sender (telemetry/metrics.py, transfer group)
            if state is State.COMPLETED:
                metrics.TRANSFER_BYTES.inc(b.total)
                metrics.TRANSFER_BATCH_SECONDS.observe(time.monotonic() - b.started)
            else:
                metrics.TRANSFER_FAILURES.labels(reason=_failure_label(reason)).inc()
        b.reason = reason
        b.keep = None
        b.state = state
        b.event.set()
        if b.segment is not None:
            seg = b.segment
            while seg._pending and seg._pending[0].state is not State.PENDING:
                seg._pending.popleft()

    def _fail_all(self, reason: str) -> None:
        for b in list(self._inflight):
            if b.request:
                self._orphans.append(b.request)
                b.request = 0
            self._finish(b, State.FAILED, reason)
        self._inflight = []
        for seg in self._segments.values():
            for b in list(seg._pending) + list(seg._notifies):
                self._finish(b, State.FAILED, reason)

    # ------------------------------------------------------------------ callbacks (thread)
    def _on_am(self, arg, header, header_length, data, length, param) -> int:
        try:
            if param and param.contents.recv_attr & ucp.UCP_AM_RECV_ATTR_FLAG_RNDV:
                return ucp.UCS_OK  # never sent by us (eager only); drop it
            sender = ctypes.string_at(header, header_length).decode(errors="replace")
            self._notifies.append(Notify(sender, ctypes.string_at(data, length)))
            self._notify_event.set()
        except Exception:  # noqa: BLE001 - never raise into C
            pass
        return ucp.UCS_OK

    def _on_ep_error(self, arg, ep, status) -> None:
        try:
            seg = self._ep_ids.get(int(arg or 0))
            if seg is not None:
                self._post(self._close_segment, seg,
                           f"UCX endpoint error: {self._lib.status_string(status)} ({status})", True)
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ memory
    def register_memory(self, ptr: int, length: int, location: str = "cpu") -> Region:
        """Register [ptr, ptr + length) bytes for RMA; location "cpu" or "cuda[:N]" (CUDA memory via
        UCS_MEMORY_TYPE_CUDA). Regions of one engine must not overlap. Raises ValueError on bad
        arguments, UCXError if UCX refuses the mapping."""
        if not isinstance(ptr, int) or ptr <= 0:
            raise ValueError(f"ptr must be a positive address, got {ptr!r}")
        if not isinstance(length, int) or length <= 0:
            raise ValueError(f"length must be > 0 bytes, got {length!r}")
        if location == "cpu":
            mem_type = ucp.UCS_MEMORY_TYPE_HOST
        elif location == "cuda" or location.startswith("cuda:"):
            mem_type = ucp.UCS_MEMORY_TYPE_CUDA
        else:
            raise ValueError(f"location must be 'cpu' or 'cuda:N', got {location!r}")
        with self._lock:
            for r in self._regions:
                if ptr < r.base + r.length and r.base < ptr + length:
                    raise ValueError(f"[{ptr:#x}, +{length}) overlaps registered region "
                                     f"[{r.base:#x}, +{r.length})")
        region = self._call(self._map, ptr, length, location, mem_type)
        with self._lock:
            i = bisect.bisect(self._region_bases, ptr)
            self._regions.insert(i, region)
            self._region_bases.insert(i, ptr)
        return region

    def _map(self, ptr, length, location, mem_type) -> Region:
        lib = self._lib
        if mem_type == ucp.UCS_MEMORY_TYPE_CUDA:
            _cuda_context_current(location)
        mp = ucp.ucp_mem_map_params_t()
        mp.field_mask = (ucp.UCP_MEM_MAP_PARAM_FIELD_ADDRESS | ucp.UCP_MEM_MAP_PARAM_FIELD_LENGTH
                         | ucp.UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE)
        mp.address, mp.length, mp.memory_type = ptr, length, mem_type
        memh = ctypes.c_void_p()
        lib.check(lib.ucp_mem_map(self._ctx, ctypes.byref(mp), ctypes.byref(memh)), "ucp_mem_map")
        buf, blen = ctypes.c_void_p(), ctypes.c_size_t()
        st = lib.ucp_rkey_pack(self._ctx, memh, ctypes.byref(buf), ctypes.byref(blen))
        if st != ucp.UCS_OK:
            lib.ucp_mem_unmap(self._ctx, memh)
            lib.check(st, "ucp_rkey_pack")
        rkey = ctypes.string_at(buf, blen.value)
        lib.ucp_rkey_buffer_release(buf)
        return Region(ptr, length, location, memh.value, rkey)

    def unregister_memory(self, region: Region) -> None:
        """Unmap a region (peers that still write into it get errors; unpublish first)."""
        with self._lock:
            if region not in self._regions:
                raise ValueError("region is not registered with this engine")
            i = self._regions.index(region)
            del self._regions[i]
            del self._region_bases[i]
        self._call(self._lib.ucp_mem_unmap, self._ctx, region.memh)

    def _find_local(self, addr: int, n: int) -> Region:
        i = bisect.bisect_right(self._region_bases, addr) - 1
        if i >= 0:
            r = self._regions[i]
            if addr + n <= r.base + r.length:
                return r
        raise BoundsError(f"local range [{addr:#x}, +{n}) is outside every registered region")

    # ------------------------------------------------------------------ segments
    def publish(self, kv_layout: registry_pb2.KVLayout | None = None) -> registry_pb2.SegmentDescriptor:
        """This engine's segment descriptor: name, incarnation, UCP worker address, every registered
        region with its packed rkey, and the owner's KV layout. Register it with the registry
        (RegistryClient.publish) so peers can open it."""
        desc = registry_pb2.SegmentDescriptor(name=self.name, incarnation=self.incarnation,
                                              worker_address=self.worker_address,
                                              host_id=self._host_id, pid=os.getpid(),
                                              pid_start_ticks=pid_start_ticks(os.getpid()) or 0)
        with self._lock:
            for r in self._regions:
                desc.regions.add(base=r.base, length=r.length, rkey=r.rkey, location=r.location)
        if kv_layout is not None:
            desc.kv_layout.CopyFrom(kv_layout)
        desc.digest = descriptor_digest(desc)
        return desc

    def open_segment(self, target: str | registry_pb2.SegmentDescriptor,
                     incarnation: str | None = None) -> Segment:
        """Open (connect to) a peer's segment, from its descriptor or its name (through `resolver`).

        Reuses the open handle when the descriptor's incarnation is unchanged; a new incarnation
        (peer restarted) drops the old handle first. With a name, `incarnation` (when the caller
        knows which one it wants, e.g. from a KVDestination) forces a registry lookup if the cached
        descriptor is another one. Raises DescriptorError for malformed descriptors, KeyError for
        an unknown name, SegmentClosed when the owner process on this host is gone, UCXError when
        UCX cannot reach the peer."""
        with self._open_lock:
            return self._open_segment(target, incarnation)

    def _open_segment(self, target: str | registry_pb2.SegmentDescriptor,
                      incarnation: str | None) -> Segment:
        if isinstance(target, str):
            if self.resolver is None:
                raise TransferError("open_segment(name) needs a resolver (registry client)")
            with self._lock:
                old = self._segments.get(target)
            if old is not None and old.alive and old.local_pid and \
                    pid_start_ticks(old.local_pid) != old.local_start:
                self._call(self._close_segment, old, "owner process exited", True)
            desc = self.resolver.get_segment(target)
            dead = old is None or not old.alive
            if ((dead and self._dropped.get(target) == desc.incarnation)
                    or (incarnation and desc.incarnation != incarnation)):
                # the cached descriptor is the one that failed, or not the one asked for
                desc = self.resolver.get_segment(target, refresh=True)
            if incarnation and desc.incarnation != incarnation:
                raise SegmentClosed(f"segment {target!r}: registry has incarnation "
                                    f"{desc.incarnation}, not {incarnation}")
        else:
            desc = target
        self._validate_descriptor(desc)
        with self._lock:
            old = self._segments.get(desc.name)
        if old is not None:
            if old.alive and old.incarnation == desc.incarnation:
                return old
            self._call(self._close_segment, old, "replaced by a new incarnation", True)
        seg = Segment(name=desc.name, incarnation=desc.incarnation, descriptor=desc,
                      kv_layout=desc.kv_layout)
        if desc.host_id == self._host_id and desc.pid > 0:
            seg.local_pid, seg.local_start = desc.pid, desc.pid_start_ticks
            if pid_start_ticks(desc.pid) != desc.pid_start_ticks:
                raise SegmentClosed(f"segment {desc.name!r}: owner process {desc.pid} on this host "
                                    f"is gone (stale descriptor)")
        for r in sorted(desc.regions, key=lambda r: r.base):
            seg._regions.append(_RemoteRegion(r.base, r.length, bytes(r.rkey)))
            seg._bases.append(r.base)
        self._call(self._connect, seg)
        with self._lock:
            self._segments[desc.name] = seg
        return seg

    @staticmethod
    def _validate_descriptor(desc) -> None:
        if not isinstance(desc, registry_pb2.SegmentDescriptor):
            raise DescriptorError(f"expected a SegmentDescriptor, got {type(desc).__name__}")
        if not desc.name:
            raise DescriptorError("segment descriptor has no name")
        if not desc.incarnation:
            raise DescriptorError(f"segment {desc.name!r}: descriptor has no incarnation")
        if len(desc.worker_address) < 16:
            raise DescriptorError(f"segment {desc.name!r}: worker_address is missing or truncated "
                                  f"({len(desc.worker_address)} bytes)")
        if desc.digest != descriptor_digest(desc):
            raise DescriptorError(f"segment {desc.name!r}: descriptor digest mismatch (corrupted or "
                                  f"edited descriptor; UCX would parse garbage)")
        regions = sorted(desc.regions, key=lambda r: r.base)
        prev_end = 0
        for i, r in enumerate(regions):
            if r.length == 0 or r.base == 0:
                raise DescriptorError(f"segment {desc.name!r}: region {i} has base {r.base:#x} "
                                      f"length {r.length}")
            if r.base + r.length > 1 << 64:
                raise DescriptorError(f"segment {desc.name!r}: region {i} wraps the address space")
            if not r.rkey:
                raise DescriptorError(f"segment {desc.name!r}: region {i} has no rkey")
            if r.base < prev_end:
                raise DescriptorError(f"segment {desc.name!r}: regions overlap at {r.base:#x}")
            prev_end = r.base + r.length

    def _connect(self, seg: Segment) -> None:
        lib = self._lib
        addr = ctypes.create_string_buffer(seg.descriptor.worker_address,
                                           len(seg.descriptor.worker_address))
        ep_id = id(seg) & 0x7FFFFFFFFFFF
        ep_params = ucp.ucp_ep_params_t()
        ep_params.field_mask = (ucp.UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                                | ucp.UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE)
        ep_params.address = ctypes.cast(addr, ctypes.c_void_p)
        if self.error_mode == "peer":
            ep_params.err_mode = ucp.UCP_ERR_HANDLING_MODE_PEER
            ep_params.field_mask |= ucp.UCP_EP_PARAM_FIELD_ERR_HANDLER
            ep_params.err_handler.cb = ctypes.cast(self._ep_err_cb, ctypes.c_void_p)
            ep_params.err_handler.arg = ep_id
        else:
            ep_params.err_mode = ucp.UCP_ERR_HANDLING_MODE_NONE
        ep = ctypes.c_void_p()
        try:
            lib.check(lib.ucp_ep_create(self._worker, ctypes.byref(ep_params), ctypes.byref(ep)),
                      f"ucp_ep_create to segment {seg.name!r}")
        except UCXError as e:
            raise DescriptorError(str(e)) from e
        seg._ep = ep.value
        self._ep_ids[ep_id] = seg
        for i, r in enumerate(seg._regions):
            buf = ctypes.create_string_buffer(r.rkey_buf, len(r.rkey_buf))
            rk = ctypes.c_void_p()
            st = lib.ucp_ep_rkey_unpack(seg._ep, buf, ctypes.byref(rk))
            if st != ucp.UCS_OK:
                self._close_segment(seg, "bad rkey", force=True)
                raise DescriptorError(f"segment {seg.name!r}: region {i} rkey does not unpack: "
                                      f"{lib.status_string(st)}")
            r.rkey = rk.value

    def _close_segment(self, seg: Segment, reason: str, force: bool) -> None:
        """Thread-side: fail the segment's pending work, destroy rkeys, close its endpoint."""
        if not seg.alive and not seg._ep:
            return
        seg.alive = False
        seg.failure = reason
        self._dropped[seg.name] = seg.incarnation
        if self.resolver is not None and hasattr(self.resolver, "invalidate"):
            self.resolver.invalidate(seg.name)
        for b in list(seg._pending) + list(seg._notifies):
            if b.request:
                self._orphans.append(b.request)
                b.request = 0
            self._finish(b, State.FAILED, f"segment {seg.name!r} dropped: {reason}")
        seg._pending.clear()
        seg._notifies.clear()
        self._inflight = [b for b in self._inflight if b.state is State.PENDING]
        for r in seg._regions:
            if r.rkey:
                self._lib.ucp_rkey_destroy(r.rkey)
                r.rkey = 0
        if seg._ep:
            p = ucp.ucp_request_param_t()
            if force:
                p.op_attr_mask = ucp.UCP_OP_ATTR_FIELD_FLAGS
                p.flags = ucp.UCP_EP_CLOSE_FLAG_FORCE
            req = self._lib.ucp_ep_close_nbx(seg._ep, ctypes.byref(p))
            if ucp.ptr_status(req) == ucp.UCS_INPROGRESS:
                self._orphans.append(req)
            seg._ep = 0
        self._ep_ids = {k: v for k, v in self._ep_ids.items() if v is not seg}
        with self._lock:
            if self._segments.get(seg.name) is seg:
                del self._segments[seg.name]

    def close_segment(self, seg: Segment) -> None:
        """Drop a segment handle (pending batches to it FAIL)."""
        if not self._closed:
            self._call(self._close_segment, seg, "closed by the user", False)

    # ------------------------------------------------------------------ transfers
    def _new_batch(self, seg: Segment | None, total: int, timeout_s: float | None) -> _Batch:
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        with self._lock:
            bid = self._next_bid
            self._next_bid += 1
            now = time.monotonic()
            b = _Batch(bid, seg, total, now + t, started=now)
            b.timeout = t
            self._batches[bid] = b
            while len(self._batches) > _MAX_KEPT_BATCHES:
                oldest = next(iter(self._batches.values()))
                if oldest.state is State.PENDING:
                    break
                self._batches.popitem(last=False)
        return b

    def submit(self, seg: Segment, descs: Sequence[tuple[int, int, int]], op: Op = Op.WRITE, *,
               timeout_s: float | None = None, coalesce: bool = True) -> int:
        """Submit one asynchronous batch of (local addr, remote addr, nbytes) transfers -> batch id.

        op WRITE puts local -> remote, READ gets remote -> local. Every local range must lie in one
        registered region and every remote range in one region of `seg`'s descriptor; otherwise
        BoundsError is raised and nothing is posted. With `coalesce`, descriptors that continue the
        previous one on both sides are merged (fewer, larger UCX ops). Raises SegmentClosed when the
        handle was dropped. Never blocks on the network."""
        if not isinstance(seg, Segment):
            raise TypeError(f"submit needs a Segment from open_segment, got {type(seg).__name__}")
        if not seg.alive:
            raise SegmentClosed(f"segment {seg.name!r} was dropped ({seg.failure}); open it again")
        op = Op(op)
        ops: list[tuple[int, int, int, int, int]] = []  # (local, remote, n, memh, rkey-region idx)
        total = 0
        with self._lock:
            for i, d in enumerate(descs):
                try:
                    laddr, raddr, n = (int(x) for x in d)
                except (TypeError, ValueError):
                    raise ValueError(f"descriptor {i}: expected (local addr, remote addr, nbytes), "
                                     f"got {d!r}") from None
                if n <= 0:
                    raise ValueError(f"descriptor {i}: nbytes must be > 0, got {n}")
                try:
                    lreg = self._find_local(laddr, n)
                    rreg = seg.find(raddr, n)
                except BoundsError as e:
                    raise BoundsError(f"descriptor {i}: {e}") from None
                total += n
                if coalesce and ops:
                    pl, pr, pn, pm, prr = ops[-1]
                    if pl + pn == laddr and pr + pn == raddr and pm == lreg.memh and prr is rreg:
                        ops[-1] = (pl, pr, pn + n, pm, prr)
                        continue
                ops.append((laddr, raddr, n, lreg.memh, rreg))
        b = self._new_batch(seg, total, timeout_s)
        b.nops = len(ops)
        b.kind = "write" if op is Op.WRITE else "read"
        self._post(self._post_batch, b, ops, op)
        return b.bid

    def _post_batch(self, b: _Batch, ops, op: Op) -> None:
        seg = b.segment
        if not seg.alive or not seg._ep:
            self._finish(b, State.FAILED, f"segment {seg.name!r} dropped: {seg.failure}")
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
                self._finish(b, State.FAILED, f"UCX: {lib.status_string(st)} ({st})")
                self._close_segment(seg, f"batch {b.bid} failed to post", force=True)
                return
            else:
                free(req)
        b.done = done
        seg._pending.append(b)
        self._flush_into(b, seg)

    def _flush_into(self, b: _Batch, seg: Segment) -> None:
        req = self._lib.ucp_ep_flush_nbx(seg._ep, ctypes.byref(self._flush_param))
        if self._track(b, seg, req, "UCX flush"):
            self._pump_notifies(seg)

    def _track(self, b: _Batch, seg: Segment, req, what: str) -> bool:
        """Complete ``b`` or park it in flight by the status of the UCX request ``req`` it waits on;
        on an error fail it, close ``seg`` and return False."""
        st = ucp.ptr_status(req)
        if st == ucp.UCS_OK:
            self._finish(b, State.COMPLETED)
        elif st == ucp.UCS_INPROGRESS:
            b.request = req
            self._inflight.append(b)
        else:
            reason = f"{what}: {self._lib.status_string(st)} ({st})"
            self._finish(b, State.FAILED, reason)
            self._close_segment(seg, reason, force=True)
            return False
        return True

    def status(self, bid: int) -> BatchStatus:
        """PENDING / COMPLETED / FAILED(reason) of a batch (or a notify), with bytes done."""
        with self._lock:
            b = self._batches.get(bid)
        if b is None:
            raise KeyError(f"unknown batch id {bid}")
        return BatchStatus(b.state, b.done, b.total, b.reason)

    def wait(self, bid: int, timeout_s: float | None = None) -> BatchStatus:
        """Block until the batch is terminal (or timeout_s passes) and return its status. The
        batch's own deadline bounds the wait when timeout_s is None."""
        with self._lock:
            b = self._batches.get(bid)
        if b is None:
            raise KeyError(f"unknown batch id {bid}")
        b.event.wait(timeout_s if timeout_s is not None else self._timeout_of(b) + 5.0)
        return BatchStatus(b.state, b.done, b.total, b.reason)

    def release(self, bid: int) -> None:
        """Forget a terminal batch id (optional; old terminal batches are pruned anyway)."""
        with self._lock:
            b = self._batches.get(bid)
            if b is not None and b.state is not State.PENDING:
                del self._batches[bid]

    # ------------------------------------------------------------------ notifies
    def send_notify(self, seg: Segment, payload: bytes, *, timeout_s: float | None = None) -> int:
        """Send a small message to `seg`'s owner -> id (status/wait like a batch). It is sent only
        after every batch submitted earlier to that segment COMPLETED (UCX flush = remote
        completion), so the peer sees it after those bytes are in place; if one of them FAILED the
        notify FAILS too and is not sent. payload: bytes, at most 64 KiB (eager AM)."""
        if not isinstance(seg, Segment):
            raise TypeError(f"send_notify needs a Segment, got {type(seg).__name__}")
        payload = bytes(payload)
        if len(payload) > 65536:
            raise ValueError(f"notify payload is {len(payload)} bytes; the limit is 65536")
        if not seg.alive:
            raise SegmentClosed(f"segment {seg.name!r} was dropped ({seg.failure}); open it again")
        b = self._new_batch(seg, len(payload), timeout_s)
        b.kind = "notify"
        b.keep = (self.name.encode(), payload)
        self._post(self._queue_notify, b)
        return b.bid

    def _queue_notify(self, b: _Batch) -> None:
        seg = b.segment
        if not seg.alive or not seg._ep:
            self._finish(b, State.FAILED, f"segment {seg.name!r} dropped: {seg.failure}")
            return
        b.after = seg._pending[-1] if seg._pending else None
        seg._notifies.append(b)
        self._pump_notifies(seg)

    def _pump_notifies_all(self) -> None:
        for seg in list(self._segments.values()):
            if seg._notifies:
                self._pump_notifies(seg)

    def _pump_notifies(self, seg: Segment) -> None:
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
                self._finish(b, State.FAILED, f"earlier batch {after.bid} failed: {after.reason}")
                continue
            header, payload = b.keep
            req = self._lib.ucp_am_send_nbx(seg._ep, NOTIFY_AM_ID, header, len(header), payload,
                                            len(payload), ctypes.byref(self._am_param))
            if not self._track(b, seg, req, "UCX am send"):
                return

    def poll_notifies(self) -> list[Notify]:
        """Notifies received since the last call, in arrival order (never blocks)."""
        out = []
        while self._notifies:
            out.append(self._notifies.popleft())
        self._notify_event.clear()
        if self._notifies:
            self._notify_event.set()
        return out

    def wait_notify(self, timeout_s: float) -> list[Notify]:
        """poll_notifies, first waiting up to timeout_s seconds for at least one."""
        self._notify_event.wait(timeout_s)
        return self.poll_notifies()

    # ------------------------------------------------------------------ misc
    def segments(self) -> dict[str, Segment]:
        with self._lock:
            return dict(self._segments)

    def regions(self) -> list[Region]:
        with self._lock:
            return list(self._regions)

