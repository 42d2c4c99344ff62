"""EtcdBackend: worker records in etcd v3, so registry replicas share them and a restart keeps them.

Keys, under a prefix per cluster (default "/halfmoon/default/"):

  <prefix>workers/<worker_id>        StoredWorker (record, sha256 of the lease secret, TTL), attached
                                     to one etcd lease per worker; etcd deletes it when the lease
                                     is not kept alive (the worker's heartbeats, relayed by the
                                     registry, are the keep-alives)
  <prefix>unregistered/<worker_id>   written in the same transaction as an Unregister's delete, so a
                                     watcher tells "unregistered" from "lease expired"

Every change is a compare-and-set transaction on the record's mod revision. Watch events come from
one etcd watch per registry process, started at the revision of the snapshot it read, so no change
is missed; a lost watch (etcd restart, compaction) reads the snapshot again and emits the
difference. A record's etcd version tells ADDED (1: a new key, i.e. a new incarnation of the worker
id after its lease ended) from UPDATED (its owner replaced it).

The client library is etcd3gw (etcd's JSON gRPC gateway over `requests`): maintained, pure Python,
and it brings no protobuf or grpcio of its own, which the project pins (docs/architecture.md,
"Registry backends", says why not python-etcd3 or aetcd). Its watcher hides the end of a stream, so
the watch stream is read here from the same gateway endpoint.
"""

from __future__ import annotations

import base64
import json
import logging
import threading

import etcd3gw
import requests
from etcd3gw import exceptions as etcd_exc

from protos import registry_pb2
from transfer_svc.registry_backend import BackendUnavailable, Conflict, Held, RegistryBackend
from transfer_svc.registry_watch import WatchHub

log = logging.getLogger(__name__)
_Ev = registry_pb2.WorkerEvent


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _range_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


class EtcdBackend(RegistryBackend):
    """Args:
        endpoints: etcd client URLs' "host:port" (tried in order; the next on a connection error).
        prefix: key prefix of this cluster's records (ends with "/").
        ca_cert, cert, key: TLS (https) to etcd: CA bundle, client certificate and key files.
        timeout_s: per-request timeout, seconds.
    Raises BackendUnavailable when no endpoint answers at start.
    """

    def __init__(self, endpoints: list[str], prefix: str = "/halfmoon/default/", *,
                 ca_cert: str | None = None, cert: str | None = None, key: str | None = None,
                 timeout_s: float = 5.0):
        if not endpoints:
            raise ValueError("EtcdBackend needs at least one endpoint")
        if not prefix.endswith("/"):
            raise ValueError(f"etcd prefix must end with '/', got {prefix!r}")
        self.hub = WatchHub()
        self._clients = []
        for ep in endpoints:
            host, _, port = ep.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"etcd endpoint must be host:port, got {ep!r}")
            self._clients.append(etcd3gw.Etcd3Client(
                host=host, port=int(port), protocol="https" if ca_cert else "http",
                ca_cert=ca_cert, cert_cert=cert, cert_key=key, timeout=timeout_s, api_path="/v3/"))
        self._current = 0
        self._workers = (prefix + "workers/").encode()
        self._tombs = (prefix + "unregistered/").encode()
        self._stop = threading.Event()
        self._stream: requests.Response | None = None
        revision = self._resync()  # fail fast when etcd is not there
        self._watcher = threading.Thread(target=self._watch_loop, args=(revision,),
                                         name="registry-etcd-watch", daemon=True)
        self._watcher.start()

    # ---- transport
    def _client(self):
        return self._clients[self._current]

    def _post(self, path: str, body: dict) -> dict:
        for _ in range(len(self._clients)):
            c = self._client()
            try:
                return c.post(c.get_url(path), json=body)
            except (etcd_exc.ConnectionFailedError, etcd_exc.ConnectionTimeoutError) as e:
                last = e
                self._current = (self._current + 1) % len(self._clients)
        raise BackendUnavailable(f"no etcd endpoint answers: {last}")

    def _held(self, kv: dict) -> Held:
        stored = registry_pb2.StoredWorker.FromString(base64.b64decode(kv.get("value", "")))
        return Held(stored.worker, format(int(kv.get("lease", 0)), "x"), stored.secret_sha256,
                    stored.ttl_seconds, int(kv["mod_revision"]))

    def _range(self, key: bytes, prefix: bool) -> tuple[list[dict], int]:
        body = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(_range_end(key))
        r = self._post("/kv/range", body)
        return r.get("kvs", []), int(r["header"]["revision"])

    def _revoke(self, lease_hex: str) -> None:
        try:
            self._post("/kv/lease/revoke", {"ID": int(lease_hex, 16)})
        except etcd_exc.Etcd3Exception:
            pass  # already gone: its keys are deleted either way

    # ---- RegistryBackend
    def get(self, worker_id):
        kvs, _ = self._range(self._workers + worker_id.encode(), prefix=False)
        return self._held(kvs[0]) if kvs else None

    def list(self):
        kvs, _ = self._range(self._workers, prefix=True)
        return [self._held(kv) for kv in kvs]

    def put(self, record, secret_sha256, ttl_s, prev):
        key = _b64(self._workers + record.worker_id.encode())
        lease = int(self._post("/lease/grant", {"TTL": ttl_s, "ID": 0})["ID"])
        value = registry_pb2.StoredWorker(worker=record, secret_sha256=secret_sha256,
                                          ttl_seconds=ttl_s).SerializeToString()
        cmp = ({"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}
               if prev is None else
               {"key": key, "result": "EQUAL", "target": "MOD", "mod_revision": prev.revision})
        r = self._post("/kv/txn", {"compare": [cmp], "success": [
            {"request_put": {"key": key, "value": _b64(value), "lease": lease}}]})
        if not r.get("succeeded"):
            self._revoke(format(lease, "x"))
            raise Conflict(record.worker_id)
        if prev is not None:
            self._revoke(prev.lease_id)  # the key now lives on the new lease
        return Held(record, format(lease, "x"), secret_sha256, ttl_s, int(r["header"]["revision"]))

    def renew(self, held):
        try:
            r = self._post("/lease/keepalive", {"ID": int(held.lease_id, 16)})
        except etcd_exc.Etcd3Exception:
            return None
        ttl = int(r.get("result", {}).get("TTL", -1))
        return ttl if ttl > 0 else None

    def delete(self, held):
        wid = held.record.worker_id.encode()
        key = _b64(self._workers + wid)
        r = self._post("/kv/txn", {
            "compare": [{"key": key, "result": "EQUAL", "target": "MOD",
                         "mod_revision": held.revision}],
            "success": [{"request_put": {"key": _b64(self._tombs + wid), "value": _b64(b"1"),
                                         "lease": int(held.lease_id, 16)}},
                        {"request_delete_range": {"key": key}}]})
        if not r.get("succeeded"):
            return False
        self._revoke(held.lease_id)  # also deletes the tombstone
        return True

    def close(self) -> None:
        self._stop.set()
        self.hub.close()
        stream = self._stream
        if stream is not None:
            stream.close()

    # ---- watch
    def _resync(self) -> int:
        kvs, revision = self._range(self._workers, prefix=True)
        held = [self._held(kv) for kv in kvs]
        self.hub.resync({h.record.worker_id: h.record for h in held})
        return revision

    def _watch_loop(self, revision: int) -> None:
        backoff, lost = 0.1, False
        while not self._stop.is_set():
            try:
                self._follow(revision)
            except Exception as e:  # noqa: BLE001 - this thread must never die; close() ends it
                if self._stop.is_set():
                    return
                if not lost:
                    log.warning("etcd watch lost (%s); retrying", type(e).__name__)
                lost = True
            if self._stop.wait(backoff):
                return
            try:
                revision = self._resync()
            except BackendUnavailable:
                backoff = min(2.0, backoff * 2)
                continue
            if lost:
                log.info("etcd watch restored at revision %d", revision)
            backoff, lost = 0.1, False

    def _follow(self, revision: int) -> None:
        prefix = self._workers[:-len(b"workers/")]
        c = self._client()
        self._stream = c.session.post(c.get_url("/watch"), stream=True, json={"create_request": {
            "key": _b64(prefix), "range_end": _b64(_range_end(prefix)),
            "start_revision": revision + 1, "prev_kv": True}})
        tombs: dict[bytes, int] = {}  # worker id -> revision of its Unregister
        try:
            for line in self._stream.iter_lines():
                if self._stop.is_set():
                    return
                if not line.strip():
                    continue
                result = json.loads(line).get("result", {})
                if result.get("canceled"):
                    return  # e.g. compacted past our revision: resync
                for ev in result.get("events", []):
                    self._apply(ev, tombs)
        finally:
            self._stream.close()

    def _apply(self, ev: dict, tombs: dict[bytes, int]) -> None:
        kv = ev["kv"]
        key = base64.b64decode(kv["key"])
        deleted = ev.get("type") == "DELETE"  # proto3 JSON leaves out PUT, the default
        if key.startswith(self._tombs):
            if not deleted:
                tombs[key[len(self._tombs):]] = int(kv["mod_revision"])
            return
        if not key.startswith(self._workers):
            return
        if deleted:
            prev = ev.get("prev_kv")
            if prev is None:
                return
            wid = key[len(self._workers):]
            reason = ("unregistered" if tombs.pop(wid, None) == int(kv["mod_revision"])
                      else "lease expired")
            if reason == "lease expired":
                log.info("lease of worker %s expired", wid.decode(errors="replace"))
            self.hub.apply(_Ev.REMOVED, self._held(prev).record, reason)
        else:
            kind = _Ev.ADDED if int(kv.get("version", 1)) == 1 else _Ev.UPDATED
            self.hub.apply(kind, self._held(kv).record)
