"""Segments: this engine's descriptor, and the open handles of peers' segments.

A SegmentDescriptor (protos/registry.proto) names a peer's memory: its UCP worker address, every
region with its packed rkey, its KV layout, and owner identity (host id, pid, start time). Opening
one validates it in the caller's thread (UCX aborts the process on some corrupted worker addresses
and rkeys, so a digest and the region list are checked first), then connects an endpoint and
unpacks the rkeys on the progress thread.

Closing a segment (peer failed, new incarnation, user, engine close) fails the work still queued
on it, destroys its rkeys, closes its endpoint and drops the handle; later submits on it raise
SegmentClosed, and `open(name)` fetches a fresh descriptor.

Endpoints use UCX error-handling mode NONE by default, because mode PEER makes UCX drop the
shared-memory lanes (everything then goes over tcp loopback, about 0.45 GB/s). With NONE, dead
peers are caught by batch deadlines, UCX error statuses and the owner liveness check.
error_mode "peer" selects UCX's own peer-failure detection (keepalive, error callback) instead.
"""

from __future__ import annotations

import abc
import ctypes
import os
import threading
from typing import NamedTuple, Protocol

from protos import registry_pb2
from transfer_svc import ucp
from transfer_svc.digest import descriptor_digest
from transfer_svc.liveness import local_owner, owner_exited, pid_start_ticks
from transfer_svc.memory import LocalMemory
from transfer_svc.progress import ProgressThread
from transfer_svc.types import DescriptorError, RemoteRegion, Segment, SegmentClosed, TransferError
from transfer_svc.ucp import UCXError


class Resolver(Protocol):
    """Looks segment names up (a RegistryClient)."""

    def get_segment(self, name: str, refresh: bool = False) -> registry_pb2.SegmentDescriptor:
        """The descriptor published under `name`; KeyError if unknown. refresh: skip the cache."""

    def invalidate(self, name: str) -> None:
        """Forget the cached descriptor of `name` (its handle failed)."""


class SegmentWork(abc.ABC):
    """The work queued on a segment, as the batch layer keeps it."""

    @abc.abstractmethod
    def fail_segment(self, seg: Segment, reason: str) -> None:
        """Fail every batch and notify still queued on `seg` with `reason` (progress thread)."""


def validate_descriptor(desc: registry_pb2.SegmentDescriptor) -> None:
    """Raise DescriptorError unless `desc` is a well-formed descriptor whose digest matches: a
    name, an incarnation, a worker address of 16 bytes or more, and regions that are non-empty,
    non-zero, inside the 64-bit address space, each with an rkey, and not overlapping."""
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
    # regions of different ranks live in different processes: their addresses may coincide
    by_owner: dict[bytes, list] = {}
    for r in desc.regions:
        by_owner.setdefault(bytes(r.worker_address), []).append(r)
    for regions in by_owner.values():
        _check_regions(desc.name, sorted(regions, key=lambda r: r.base))


def _check_regions(desc_name: str, regions: list) -> None:
    """Regions of one process: non-empty, inside the address space, with an rkey, not overlapping."""
    prev_end = 0
    for i, r in enumerate(regions):
        if r.length == 0 or r.base == 0:
            raise DescriptorError(f"segment {desc_name!r}: region {i} has base {r.base:#x} "
                                  f"length {r.length}")
        if r.base + r.length > 1 << 64:
            raise DescriptorError(f"segment {desc_name!r}: region {i} wraps the address space")
        if not r.rkey:
            raise DescriptorError(f"segment {desc_name!r}: region {i} has no rkey")
        if r.base < prev_end:
            raise DescriptorError(f"segment {desc_name!r}: regions overlap at {r.base:#x}")
        prev_end = r.base + r.length


class Identity(NamedTuple):
    """Who this engine is, as its descriptor says."""

    name: str          # segment name (= worker id)
    incarnation: str   # a fresh uuid per engine: tells a restarted peer from the old one
    host: str          # liveness.host_id() of this host


class SegmentTable:
    """Open segments by name. `bind` the batch layer before the first open.

    Args:
        progress: runs the UCP calls. memory: the regions `publish` lists.
        identity: this engine's name, incarnation and host.
        error_mode: "none" or "peer" (module docstring). resolver: for open(name), or None.
    """

    def __init__(self, progress: ProgressThread, memory: LocalMemory, identity: Identity, *,
                 error_mode: str, resolver: Resolver | None):
        self._progress = progress
        self._memory = memory
        self.identity = identity
        self.error_mode = error_mode
        self.resolver = resolver
        self._work: SegmentWork | None = None
        self._segments: dict[str, Segment] = {}
        self._lock = threading.Lock()  # guards _segments between caller threads and the thread
        # one open at a time: two racing opens of the same peer would make two endpoints, and
        # batches/notifies on the one that loses the race would be orphaned
        self._open_lock = threading.Lock()
        self._ep_ids: dict[int, Segment] = {}  # endpoint error-callback arg -> its segment
        self._dropped: dict[str, str] = {}  # segment name -> incarnation of its last failed handle
        self._ep_err_cb = ucp.ERR_HANDLER_CB(self._on_ep_error)

    def bind(self, work: SegmentWork) -> None:
        """Attach the batch layer, whose queued work close() fails."""
        self._work = work

    def publish(self, kv_layout: registry_pb2.KVLayout | None) -> registry_pb2.SegmentDescriptor:
        """This engine's descriptor: name, incarnation, worker address, owner identity, every
        registered region with its packed rkey, the KV layout, and the digest over them."""
        me = self.identity
        desc = registry_pb2.SegmentDescriptor(name=me.name, incarnation=me.incarnation,
                                              worker_address=self._progress.worker_address,
                                              host_id=me.host, pid=os.getpid(),
                                              pid_start_ticks=pid_start_ticks(os.getpid()) or 0)
        for r in self._memory.regions():
            desc.regions.add(base=r.base, length=r.length, rkey=r.rkey, location=r.location)
        if kv_layout is not None:
            desc.kv_layout.CopyFrom(kv_layout)
        desc.digest = descriptor_digest(desc)
        return desc

    def snapshot(self) -> dict[str, Segment]:
        """A copy of name -> open segment."""
        with self._lock:
            return dict(self._segments)

    def open_segments(self) -> list[Segment]:
        """The open segments (progress thread; list() of a dict is atomic under the GIL)."""
        return list(self._segments.values())

    # ------------------------------------------------------------------ open (caller side)
    def open(self, target: str | registry_pb2.SegmentDescriptor,
             incarnation: str | None = None) -> Segment:
        """Open a segment from its descriptor or name; see TransferEngine.open_segment."""
        with self._open_lock:
            return self._open(target, incarnation)

    def _resolve(self, name: str, incarnation: str | None) -> registry_pb2.SegmentDescriptor:
        if self.resolver is None:
            raise TransferError("open_segment(name) needs a resolver (registry client)")
        with self._lock:
            old = self._segments.get(name)
        if old is not None and old.alive and owner_exited(old):
            self._progress.call(self.close, old, "owner process exited", True)
        desc = self.resolver.get_segment(name)
        dead = old is None or not old.alive
        if ((dead and self._dropped.get(name) == desc.incarnation)
                or (incarnation and desc.incarnation != incarnation)):
            # the cached descriptor is the one that failed, or not the one asked for
            desc = self.resolver.get_segment(name, refresh=True)
        if incarnation and desc.incarnation != incarnation:
            raise SegmentClosed(f"segment {name!r}: registry has incarnation "
                                f"{desc.incarnation}, not {incarnation}")
        return desc

    def _open(self, target: str | registry_pb2.SegmentDescriptor,
              incarnation: str | None) -> Segment:
        desc = self._resolve(target, incarnation) if isinstance(target, str) else target
        validate_descriptor(desc)
        with self._lock:
            old = self._segments.get(desc.name)
        if old is not None:
            if old.alive and old.incarnation == desc.incarnation:
                return old
            self._progress.call(self.close, old, "replaced by a new incarnation", True)
        seg = Segment(name=desc.name, incarnation=desc.incarnation, descriptor=desc,
                      kv_layout=desc.kv_layout)
        seg.local_pid, seg.local_start = local_owner(desc, self.identity.host)
        if owner_exited(seg):
            raise SegmentClosed(f"segment {desc.name!r}: owner process {desc.pid} on this host "
                                f"is gone (stale descriptor)")
        # only the regions this endpoint's process owns (rank 0's): another rank's rkeys belong to
        # another UCP worker (transfer_svc/rank_regions.py opens those as their own segments)
        for r in sorted((r for r in desc.regions if not r.worker_address), key=lambda r: r.base):
            seg._regions.append(RemoteRegion(r.base, r.length, bytes(r.rkey)))
            seg._bases.append(r.base)
        self._progress.call(self._connect, seg)
        with self._lock:
            self._segments[desc.name] = seg
        return seg

    # ------------------------------------------------------------------ progress thread
    def _connect(self, seg: Segment) -> None:
        """Create the endpoint and unpack every rkey; DescriptorError if UCX refuses either."""
        lib = self._progress.lib
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
            lib.check(lib.ucp_ep_create(self._progress.worker, ctypes.byref(ep_params),
                                        ctypes.byref(ep)), f"ucp_ep_create to segment {seg.name!r}")
        except UCXError as e:
            raise DescriptorError(str(e)) from e
        seg._ep = ep.value
        self._ep_ids[ep_id] = seg
        for i, r in enumerate(seg._regions):
            buf = ctypes.create_string_buffer(r.rkey_buf, len(r.rkey_buf))
            rk = ctypes.c_void_p()
            st = lib.ucp_ep_rkey_unpack(seg._ep, buf, ctypes.byref(rk))
            if st != ucp.UCS_OK:
                self.close(seg, "bad rkey", force=True)
                raise DescriptorError(f"segment {seg.name!r}: region {i} rkey does not unpack: "
                                      f"{lib.status_string(st)}")
            r.rkey = rk.value

    def close(self, seg: Segment, reason: str, force: bool) -> None:
        """Fail the segment's queued work, destroy its rkeys, close its endpoint (force: without
        flushing, for a peer presumed dead) and drop the handle. Idempotent."""
        if not seg.alive and not seg._ep:
            return
        seg.alive = False
        seg.failure = reason
        self._dropped[seg.name] = seg.incarnation
        if self.resolver is not None and hasattr(self.resolver, "invalidate"):
            self.resolver.invalidate(seg.name)
        self._work.fail_segment(seg, f"segment {seg.name!r} dropped: {reason}")
        lib = self._progress.lib
        for r in seg._regions:
            if r.rkey:
                lib.ucp_rkey_destroy(r.rkey)
                r.rkey = 0
        if seg._ep:
            p = ucp.ucp_request_param_t()
            if force:
                p.op_attr_mask = ucp.UCP_OP_ATTR_FIELD_FLAGS
                p.flags = ucp.UCP_EP_CLOSE_FLAG_FORCE
            req = lib.ucp_ep_close_nbx(seg._ep, ctypes.byref(p))
            if ucp.ptr_status(req) == ucp.UCS_INPROGRESS:
                self._progress.orphan(req)
            seg._ep = 0
        self._ep_ids = {k: v for k, v in self._ep_ids.items() if v is not seg}
        with self._lock:
            if self._segments.get(seg.name) is seg:
                del self._segments[seg.name]

    def close_all(self, reason: str) -> None:
        """Close every open segment, flushing their endpoints (teardown)."""
        for seg in self.open_segments():
            self.close(seg, reason, force=False)

    def _on_ep_error(self, arg, ep, status) -> None:
        """UCX endpoint error callback (error_mode "peer"): close that segment."""
        try:
            seg = self._ep_ids.get(int(arg or 0))
            if seg is not None:
                self._progress.post(
                    self.close, seg,
                    f"UCX endpoint error: {self._progress.lib.status_string(status)} ({status})",
                    True)
        except Exception:  # noqa: BLE001 - never raise into C
            pass
