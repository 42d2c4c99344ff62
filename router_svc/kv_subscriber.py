"""Follows one worker's ``KVEvents.Subscribe`` stream into the router's :class:`KVEventIndex`
(docs/architecture.md, Router, KV events).

The subscription resumes after the last batch applied (same incarnation) or starts from a
snapshot; a gap in the numbering, a broken stream or a restarted worker (another incarnation)
means resubscribing, which the worker answers with what was missed or a snapshot. While the
worker is unreachable its index keeps its last state (it may come back with the same cache); a
new incarnation's snapshot replaces it.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from protos import kv_events_pb2, kv_events_pb2_grpc
from router_svc.kv_index import GapError, KVEventIndex
from router_svc.worker import Worker

log = logging.getLogger("halfmoon.router.kv_events")


class KVSubscriber:
    """One worker's subscription (an asyncio task on the router's loop).

    Args:
        worker: the worker (its channel carries the router's cluster credentials).
        index: where its pages go (``index.get(worker.worker_id)``).
        retry_s: first wait before resubscribing after a failure (doubles up to 5 s).
    """

    def __init__(self, worker: Worker, index: KVEventIndex, retry_s: float = 0.2) -> None:
        self.worker = worker
        self.index = index
        self.retry_s = retry_s
        self._call = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def resubscribe(self) -> None:
        """Drop the current stream (e.g. one suspected stale); the loop subscribes again at once."""
        if self._call is not None:
            self._call.cancel()

    async def _run(self) -> None:
        backoff = self.retry_s
        idx = self.index.get(self.worker.worker_id)
        while not self.worker.removed:
            stub = kv_events_pb2_grpc.KVEventsStub(self.worker.channel)
            req = kv_events_pb2.SubscribeKVEventsRequest(incarnation=idx.incarnation, after_seq=idx.seq)
            self._call = stub.Subscribe(req)
            try:
                async for batch in self._call:
                    idx.apply(batch)
                    backoff = self.retry_s
            except GapError as e:
                log.info("%s; resubscribing", e)
                backoff = 0.0
            except asyncio.CancelledError:
                if self._call is not None and self._call.cancelled() and not self._task_cancelled():
                    backoff = 0.0  # resubscribe() cancelled the call, not the task
                else:
                    raise
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED:
                    log.debug("KV events of %s: %s", self.worker.worker_id, e.code().name)
                else:
                    backoff = 0.0
            except grpc.aio.UsageError:  # the pool closed the channel: the worker was removed
                return
            except Exception:  # never let the subscription die: the index would go stale silently
                log.exception("KV events of %s: unexpected failure; resubscribing", self.worker.worker_id)
            finally:
                self._call.cancel()
                self._call = None
            await asyncio.sleep(backoff)
            backoff = min(max(backoff * 2, self.retry_s), 5.0)

    def _task_cancelled(self) -> bool:
        task = asyncio.current_task()
        return task is not None and task.cancelling() > 0
