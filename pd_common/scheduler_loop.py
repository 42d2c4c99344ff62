"""The scheduler thread both PD workers run: drain the inbox, run one iteration, never die.

One thread owns a worker's ModelRunner, KV memory and jobs; everything else reaches it through the
``Inbox``. A failing iteration is logged and the worker's ``on_iteration_error`` fails what was in
flight loudly instead of letting the thread end (a dead scheduler would hang every caller). At
shutdown every caller still waiting — jobs the loop holds and jobs it never saw — is answered
UNAVAILABLE, so no gRPC thread keeps the process alive after SIGTERM.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, TimeoutError as FutureTimeout

import grpc

from engine.distributed.group import TPRankDied
from pd_common.inbox import Abort, Inbox, LoadQuery, Wake
from pd_common.protocol import ServiceError
from pd_common.rank_accounting import rank_accounting
from pd_common.rooms import KnownRooms
from pd_common.worker_runtime import bind_cuda_device
from protos import common_pb2


class SchedulerLoop(ABC):
    """Base of ``PrefillScheduler`` and ``DecodeScheduler``.

    Args:
        name: the thread's name; device: the runner's torch device (bound in the thread, CUDA).
        log: the worker's logger.
    """

    def __init__(self, name: str, device, log: logging.Logger):
        self.inbox = Inbox()
        self.known = KnownRooms()
        self._device = device
        self._log = log
        self._stop = False
        self._rank_died: str | None = None  # a tensor-parallel rank died: no forward can run again
        self.kv_events = None  # a pd_common.kv_events.KVEventPublisher, fed from event_cache
        self.event_cache = None  # the subclass's radix cache (enable_events=True)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def publish_kv_events(self) -> None:
        """Hand the radix cache's new events to the publisher (scheduler thread, every iteration)."""
        if self.kv_events is not None and self.event_cache is not None and self.event_cache.enabled:
            self.kv_events.publish(self.event_cache.drain_events())

    def abort_job(self, job, reason: str) -> None:
        """Queue the abort of ``job`` itself (its call or stream ended): nothing happens unless it is
        still its room's live job, so a refused duplicate never ends the request it collided with."""
        self.inbox.post(Abort(job.room, job.request_id, reason, job))

    def load(self, timeout_s: float = 60.0, per_rank: bool = False) -> common_pb2.LoadReport:
        """Load and KV accounting (pages), from the scheduler thread; ``per_rank``: with every
        tensor-parallel rank's entry (``pd_common.rank_accounting``).

        Raises ServiceError(UNAVAILABLE) when the thread has not answered within ``timeout_s``
        seconds (one very long step, or a wedged loop): a GetLoad caller gets a status, not a
        traceback in the worker's log.
        """
        fut: Future = Future()
        self.inbox.post(LoadQuery(fut, per_rank))
        try:
            return fut.result(timeout=timeout_s)
        except FutureTimeout:  # the late answer is set on a future nobody reads
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"{self._thread.name} did not report its load within {timeout_s:g} s") from None

    def answer_load(self, msg: LoadQuery, report: common_pb2.LoadReport, runner) -> None:
        """Answer ``msg`` with ``report`` (scheduler thread), adding every rank's accounting when it
        asks; a rank that cannot answer is the query's UNAVAILABLE, not the loop's failure."""
        if msg.per_rank:
            try:
                report.ranks.extend(rank_accounting(runner))
            except (TPRankDied, TimeoutError) as e:
                msg.reply.set_exception(ServiceError(grpc.StatusCode.UNAVAILABLE, str(e)))
                return
        msg.reply.set_result(report)

    def stop(self, message: str) -> None:
        """End the loop and answer every waiting caller with UNAVAILABLE ``message``."""
        self._stop = True
        self.inbox.post(Wake())
        self._thread.join(timeout=10)
        err = ServiceError(grpc.StatusCode.UNAVAILABLE, message)
        for job in self.live_jobs() + self.inbox.pending_jobs():
            self.answer_shutdown(job, err)

    def _run(self) -> None:
        bind_cuda_device(self._device)  # this thread runs the forwards (CUDA graph replay)
        while not self._stop:
            try:
                self.inbox.drain(self.idle_wait() if self._rank_died is None else 0.1, self.handle)
                if self._rank_died is None:  # else only aborts and queries are answered until stop()
                    self.iterate()
                self.publish_kv_events()
            except TPRankDied as e:  # the worker stops itself (worker_runtime): one line, no traceback
                self._rank_died = str(e)
                self._log.error("%s: %s; no more forwards", self._thread.name, e)
            except Exception:
                self._log.exception("%s iteration failed", self._thread.name)
                self.on_iteration_error()

    @abstractmethod
    def idle_wait(self) -> float:
        """Seconds to wait for a message before the next iteration (0 when work is ready)."""

    @abstractmethod
    def handle(self, msg: object) -> None:
        """One inbox message (scheduler thread)."""

    @abstractmethod
    def iterate(self) -> None:
        """One pass over the worker's queues (timeouts, admission, one forward, ...)."""

    @abstractmethod
    def on_iteration_error(self) -> None:
        """Fail the jobs an exception may have left half done."""

    @abstractmethod
    def live_jobs(self) -> list:
        """Jobs the loop holds (for the shutdown answer)."""

    @abstractmethod
    def answer_shutdown(self, job, err: ServiceError) -> None:
        """Answer one job's caller with ``err`` unless it was answered already."""
