"""The router's worker pool: prefill and decode workers from a static list or the registry,
health-checked and load-polled in the background.

- Static list (``--prefill a:1,b:2 --decode c:3``): worker id = address.
- Registry (``--registry host:port``): ``Registry.WatchWorkers`` gives a snapshot (ADDED events),
  then ADDED / UPDATED / REMOVED as workers come and go; the stream is re-opened on failure.

Every ``health_interval`` seconds each worker gets a ``grpc.health.v1.Health/Check`` and a
``GetLoad``. A worker is *healthy* while its check answers SERVING. It becomes unhealthy, until a
check passes again, at once when a check fails outright (NOT_SERVING, or the connection is refused /
reset: the process is gone) — periodic, or the immediate :meth:`WorkerPool.probe` the dispatcher runs
on both workers of a failed leg — and after ``max_timeouts`` checks in a row that time out (a frozen
process; a busy one answers within ``check_timeout``, SMG uses 5 s and 3 failures too). A failed
``GetLoad`` only keeps the previous load report.
Policies never pick unhealthy or removed workers.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import common_pb2, registry_pb2, registry_pb2_grpc
from security import OPEN, ClusterCredentials
from router_svc.policies import NoWorkerError, Policy
from router_svc.kv_index import KVEventIndex
from router_svc.kv_subscriber import KVSubscriber
from router_svc.worker import DECODE, PREFILL, Worker, kv_compatible, kv_mismatch, kv_page_bytes, kv_signature

log = logging.getLogger("halfmoon.router.pool")

_ROLE = {registry_pb2.PREFILL: PREFILL, registry_pb2.DECODE: DECODE}


class WorkerPool:
    """Workers by id, with background health/load polling.

    Args:
        model_names: model names this router serves; registry workers of another model are ignored.
        health_interval: seconds between health checks / load polls of one worker.
        check_timeout: seconds one check may take before it counts as timed out.
        max_timeouts: timed-out checks in a row that make a worker unhealthy.
        credentials: the router's cluster credentials, for its channels to workers and registry.
        kv_index: when set, every worker's ``KVEvents`` stream is followed into it (``kv_events``
            policy).
        max_context: the tokens per request this router serves; a registry worker that published a
            smaller ``--max-context`` is left out (it would refuse requests the router accepts).
    """

    def __init__(self, model_names: tuple[str, ...] = (), health_interval: float = 0.5,
                 check_timeout: float = 5.0, max_timeouts: int = 3,
                 credentials: ClusterCredentials = OPEN, kv_index: KVEventIndex | None = None,
                 max_context: int = 0) -> None:
        self.model_names = tuple(model_names)
        self.max_context = max_context
        self.left_out: dict[str, str] = {}  # worker id -> why the registry's record is not used
        self.credentials = credentials
        self.health_interval = health_interval
        self.check_timeout = check_timeout
        self.max_timeouts = max_timeouts
        self.workers: dict[str, Worker] = {}
        self.policies: list[Policy] = []
        self._tasks: dict[str, asyncio.Task] = {}
        self.kv_index = kv_index
        self._subscribers: dict[str, KVSubscriber] = {}
        self._registry_task: asyncio.Task | None = None
        self.changed = asyncio.Event()

    # -- membership -------------------------------------------------------------------------------
    def add(self, worker_id: str, role: str, address: str) -> Worker:
        """Add (or re-address) a worker and start polling it; call inside the event loop."""
        old = self.workers.get(worker_id)
        if old is not None and old.address == address and old.role == role and not old.removed:
            return old
        if old is not None:
            self.remove(worker_id, "re-registered")
        w = Worker(worker_id=worker_id, role=role, address=address)
        w.connect(self.credentials)
        self.workers[worker_id] = w
        self._tasks[worker_id] = asyncio.get_running_loop().create_task(self._poll(w))
        if self.kv_index is not None:
            self._subscribers[worker_id] = KVSubscriber(w, self.kv_index)
            self._subscribers[worker_id].start()
        log.info("worker added: %s %s %s", role, worker_id, address)
        self._notify()
        return w

    def remove(self, worker_id: str, reason: str = "") -> None:
        """Remove a worker: never picked again; its in-flight calls fail over or end (dispatch)."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return
        w.removed = True
        w.healthy = False
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()
        sub = self._subscribers.pop(worker_id, None)
        if sub is not None:
            sub.stop()
            self.kv_index.forget(worker_id)
        for p in self.policies:
            p.forget(worker_id)
        if w.channel is not None:
            asyncio.get_running_loop().create_task(w.channel.close(grace=5.0))
        log.info("worker removed: %s (%s)", worker_id, reason)
        self._notify()

    def by_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role]

    def healthy_count(self, role: str) -> int:
        return sum(1 for w in self.by_role(role) if w.available)

    @staticmethod
    def _pick(policy: Policy, workers: list[Worker], input_ids: list[int], exclude: set[str]) -> Worker:
        """``policy``'s pick among ``workers``, avoiding ``exclude`` when another is available.

        Raises:
            NoWorkerError: none of ``workers`` is available.
        """
        preferred = [w for w in workers if w.worker_id not in exclude and w.available]
        return policy.pick(preferred or workers, input_ids)

    def pick_pair(self, prefill_policy: Policy, decode_policy: Policy, input_ids: list[int],
                  exclude: set[str] = frozenset()) -> tuple[Worker, Worker]:
        """A prefill and a decode worker whose KV pools match (``Worker.kv_signature``), each picked by
        its policy, avoiding ``exclude`` when another is available. A prefill worker that matches no
        decode worker is passed over for the next one.

        Raises:
            NoWorkerError: no available worker of a role, or no matching pair (the message names the
                fields that differ and the flags that set them).
        """
        decodes = self.by_role(DECODE)
        skipped: list[Worker] = []
        while True:
            try:
                p = self._pick(prefill_policy, [w for w in self.by_role(PREFILL) if w not in skipped],
                               input_ids, exclude)
            except NoWorkerError:
                if skipped:
                    d0 = next(w for w in decodes if w.kv_signature is not None)
                    raise NoWorkerError(f"no decode worker's KV pool matches a prefill worker's: "
                                        f"{skipped[0].worker_id} vs {d0.worker_id}: {kv_mismatch(skipped[0], d0)}; "
                                        f"prefill and decode workers need the same flags") from None
                raise NoWorkerError(f"no healthy prefill worker ({len(self.by_role(PREFILL))} registered)"
                                    + self._left_out_note()) from None
            matching = [w for w in decodes if kv_compatible(p, w)]
            if matching or not decodes:
                break
            p.dispatched_since_report -= 1  # not sent there after all
            skipped.append(p)
        try:
            return p, self._pick(decode_policy, matching, input_ids, exclude)
        except NoWorkerError:
            raise NoWorkerError(f"no healthy decode worker ({len(decodes)} registered)"
                                + self._left_out_note()) from None

    def _left_out_note(self) -> str:
        if not self.left_out:
            return ""
        wid, why = next(iter(self.left_out.items()))
        return f"; {len(self.left_out)} registered worker(s) not used, e.g. {wid}: {why}"

    def mark_failed(self, w: Worker, why: str) -> None:
        """Stop picking ``w`` until a health check passes."""
        if w.healthy:
            log.warning("worker %s marked unhealthy: %s", w.worker_id, why)
            w.healthy = False
            self._notify()

    async def _check(self, w: Worker, timeout: float) -> bool | None:
        """One health check: True (SERVING), False (down: NOT_SERVING, or the connection fails), or
        None (no answer in time: a worker busy computing on a loaded CPU is slow, not dead)."""
        if w.removed:  # remove() closed its channel: a call would raise UsageError, not a status
            w.last_error = "removed from the pool"
            return False
        try:
            resp = await health_pb2_grpc.HealthStub(w.channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                     timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED):
                return None
            w.last_error = f"health check {exc.code().name}: {exc.details()}"
            return False
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            w.last_error = "health NOT_SERVING"
            return False
        return True

    def _record(self, w: Worker, result: bool | None) -> None:
        """Apply one check: down at once on False; after ``max_timeouts`` slow checks in a row on None."""
        if result is True:
            w.failures = 0
            if not w.healthy:
                w.healthy = True
                log.info("worker %s is healthy", w.worker_id)
                self._notify()
            return
        w.failures += 1
        if result is None:
            w.last_error = f"{w.failures} health checks in a row timed out"
        if result is False or w.failures >= self.max_timeouts:
            self.mark_failed(w, w.last_error)

    async def probe(self, w: Worker, timeout: float = 1.0) -> bool:
        """Health-check ``w`` now (a failed leg names a worker, but the fault may be its peer's: a decode
        worker reports UNAVAILABLE when its prefill died). Returns False when it is down."""
        result = await self._check(w, timeout)
        if result is False:
            self._record(w, result)
        return result is not False

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    # -- polling ----------------------------------------------------------------------------------
    async def _poll(self, w: Worker) -> None:
        while not w.removed:
            result = await self._check(w, self.check_timeout)
            self._record(w, result)
            if result:
                try:  # load is advisory: a slow or missing GetLoad keeps the last report
                    w.set_load(await w.stub.GetLoad(common_pb2.GetLoadRequest(), timeout=self.check_timeout))
                except grpc.aio.AioRpcError:
                    pass
            await asyncio.sleep(self.health_interval)

    # -- sources ----------------------------------------------------------------------------------
    def add_static(self, prefill: list[str], decode: list[str]) -> None:
        for addr in prefill:
            self.add(addr, PREFILL, addr)
        for addr in decode:
            self.add(addr, DECODE, addr)

    def watch_registry(self, address: str) -> None:
        """Follow ``Registry.WatchWorkers`` at ``address`` in the background (reconnecting)."""
        self._registry_task = asyncio.get_running_loop().create_task(self._watch(address))

    def _model_ok(self, model: str) -> bool:
        if not model or not self.model_names:
            return True
        names = set(self.model_names) | {Path(m).name for m in self.model_names}
        return model in names or Path(model).name in names

    def _context_short(self, worker_cap: int) -> str:
        """Why a worker serving ``worker_cap`` tokens per request (0 = unknown) cannot serve this
        router's requests, or "" when it can."""
        if worker_cap and worker_cap < self.max_context:
            return (f"its --max-context {worker_cap} is below the router's {self.max_context} "
                    f"(serve-router --max-context): give both the same cap")
        return ""

    def _leave_out(self, worker_id: str, why: str) -> None:
        if self.left_out.get(worker_id) != why:
            log.warning("not using worker %s: %s", worker_id, why)
        self.left_out[worker_id] = why
        self.remove(worker_id, why)

    async def _watch(self, address: str) -> None:
        backoff = 0.2
        while True:
            channel = self.credentials.aio_channel(address)
            try:
                stub = registry_pb2_grpc.RegistryStub(channel)
                seen: set[str] = set()
                async for ev in stub.WatchWorkers(registry_pb2.WatchWorkersRequest()):
                    backoff = 0.2
                    rec = ev.worker
                    role = _ROLE.get(rec.role)
                    if role is None:
                        continue
                    if ev.kind == registry_pb2.WorkerEvent.REMOVED:
                        self.remove(rec.worker_id, ev.reason or "removed from registry")
                        self.left_out.pop(rec.worker_id, None)
                        seen.discard(rec.worker_id)
                    elif not self._model_ok(rec.model):
                        log.warning("ignoring worker %s: model %r is not served here", rec.worker_id, rec.model)
                    elif (why := self._context_short(rec.segment.kv_layout.max_context)):
                        self._leave_out(rec.worker_id, why)
                    else:
                        self.left_out.pop(rec.worker_id, None)
                        w = self.add(rec.worker_id, role, rec.grpc_address)
                        w.kv_signature = kv_signature(rec.segment.kv_layout)
                        w.kv_page_bytes = kv_page_bytes(rec.segment.kv_layout)
                        seen.add(rec.worker_id)
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                log.warning("registry watch at %s broke: %s; retrying", address, exc.code().name)
            finally:
                await channel.close()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def close(self) -> None:
        if self._registry_task is not None:
            self._registry_task.cancel()
        for wid in list(self.workers):
            self.remove(wid, "router shutdown")
        await asyncio.sleep(0)


__all__ = ["WorkerPool", "NoWorkerError"]
