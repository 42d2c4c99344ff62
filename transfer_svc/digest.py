"""Integrity digest of a SegmentDescriptor (no UCX import: the registry uses it too)."""

from __future__ import annotations

import hashlib

from protos import registry_pb2


def descriptor_digest(desc: registry_pb2.SegmentDescriptor) -> bytes:
    """sha256 (32 bytes) over the fields UCX parses: name, incarnation, worker address and every
    region's (base, length, rkey, and its rank, kv-head range and worker address), each
    length-prefixed. The owner sets `desc.digest` to it; the
    registry and `open_segment` refuse a descriptor whose digest differs, because UCX aborts the
    process on some corrupted worker addresses and rkeys."""
    h = hashlib.sha256()
    for part in (desc.name.encode(), desc.incarnation.encode(), desc.worker_address):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    for r in desc.regions:
        h.update(r.base.to_bytes(8, "little"))
        h.update(r.length.to_bytes(8, "little"))
        h.update(len(r.rkey).to_bytes(8, "little"))
        h.update(r.rkey)
        for n in (r.rank, r.kv_head_start, r.kv_head_end):
            h.update(n.to_bytes(8, "little", signed=True))
        h.update(len(r.worker_address).to_bytes(8, "little"))
        h.update(r.worker_address)
    return h.digest()
