"""D's ``Generate`` on ``grpc.aio``: every open stream a task on one event loop, not a server thread.

The same servicer as ``decode_svc.server`` (validation, drain, hand-back, ``Abort`` and ``GetLoad``,
which stay plain functions and run in the server's thread pool, so a busy loop never delays them),
with ``Generate`` a coroutine: the request's ``out`` is a :class:`~decode_svc.stream_hub.StreamInbox`,
so a decode step's tokens reach the loop in one hand-over and each stream wakes without a thread
switch (``decode_svc.stream_hub``; ``--stream-server aio``, the default). Served by
``pd_common.aio_server.LoopServer``.
"""

from __future__ import annotations

import asyncio

from decode_svc.server import QUEUED, DecodeServicer, Refused, OpenStream
from decode_svc.stream_hub import StreamHub, aio_stream_chunks
from decode_svc.streams import StreamEnd
from pd_common.drain import Drain


class AioDecodeServicer(DecodeServicer):
    """Args: as :class:`DecodeServicer`, plus ``loop``: the aio server's event loop."""

    def __init__(self, *args, loop: asyncio.AbstractEventLoop, **kwargs):
        super().__init__(*args, **kwargs)
        self.hub = StreamHub(loop)

    async def Generate(self, request, context):
        await self.drain.refuse_new_aio(context)
        with self.drain.track():
            async for chunk in self._generate_aio(request, context):
                yield chunk

    async def _generate_aio(self, request, context):
        inbox = self.hub.inbox()
        try:  # off the loop: a grammar compiles, a stop string's detokenizer decodes the prompt
            job = await asyncio.to_thread(self.new_job, request, inbox)
        except Refused as e:
            await context.abort(e.code, e.message)
        stream = OpenStream(job)
        with self._lock:
            self._streams.add(stream)
        try:
            self.sched.submit(job)
            try:
                async for chunk in aio_stream_chunks(inbox, keepalive_s=self.queue_keepalive_s,
                                                     queued=lambda: job.state in QUEUED, coalesce=self.coalesce):
                    yield stream.passing(chunk)
            except StreamEnd as e:
                if stream.handed_back:
                    await Drain.hand_back_aio(context, f"decode worker {self.worker_id}")
                await context.abort(e.error.code, str(e.error))
        finally:
            # also on cancellation (the router or client went away): a request still running is aborted
            if not job.finish_reason:
                self.sched.abort_job(job, "decode stream cancelled")
            with self._lock:
                self._streams.discard(stream)
