"""Decode gRPC servicer: ``Generate`` (server stream of DecodeChunk), ``Abort``, ``GetLoad``.

``Generate`` validates the request (INVALID_ARGUMENT naming the field, RESOURCE_EXHAUSTED when it
can never fit, both before anything is allocated), hands it to the scheduler thread and streams
what the scheduler puts on the request's queue. A cancelled stream (router/client gone) aborts the
request. The first chunk carries P's token; a chunk carries every token produced since the
stream's last write (one while it keeps up; ``decode_svc.streams``).

Keepalive: until the first token, while the request waits in D (admission queue, KV wait, batch
slot), an empty ``DecodeChunk`` goes out every ``queue_keepalive_s`` seconds, so the router can tell
a queued request on a live D from a D that went silent (its first-token timer restarts on each one).
None is ever sent after the first token.

Drain (pd_common/drain.py): once draining, new calls are refused; :meth:`DecodeServicer.hand_back`
ends streams (all, or those that sent nothing yet) with the status the router migrates / retries.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import grpc

from decode_svc.jobs import DecodeJob, JobState
from decode_svc.scheduler import DecodeScheduler
from decode_svc.streams import StreamEnd, stream_chunks
from engine.errors import InvalidRequestError
from engine.grammar import GrammarCompiler
from pd_common.drain import Drain
from pd_common.protocol import ServiceError, validate_request, validate_samples
from pd_common.tokenizer import grammar_state
from protos import common_pb2, decode_pb2, decode_pb2_grpc

log = logging.getLogger("halfmoon.decode")

# states in which a request that has streamed nothing is queued in D, not computing
QUEUED = frozenset({JobState.PREALLOC, JobState.TRANSFER, JobState.WAITING, JobState.RETRACTED,
                    JobState.LOCAL_PREFILL})


class Refused(Exception):
    """A Generate request refused before anything was allocated: the stream ends with ``code``."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(eq=False)
class OpenStream:
    job: DecodeJob
    sent: bool = False         # a token went out
    handed_back: bool = False  # ended by the drain: the router continues it elsewhere

    def passing(self, chunk: decode_pb2.DecodeChunk) -> decode_pb2.DecodeChunk:
        """``chunk``, noted as sent (a keepalive is not a token)."""
        if chunk.token_ids or chunk.finish_reason:
            self.sent = True
        return chunk


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """Args: queue_keepalive_s: seconds between empty chunks before the first token (0 = none);
    drain: the worker's drain state (default: never draining);
    coalesce: a stream sends the tokens waiting on its queue in one chunk (``decode_svc.streams``)."""

    def __init__(self, scheduler: DecodeScheduler, worker_id: str, *, vocab_size: int,
                 max_context: int, tokenizer=None, queue_keepalive_s: float = 10.0,
                 grammars: GrammarCompiler | None = None, drain: Drain | None = None,
                 coalesce: bool = True):
        self.drain = drain or Drain("decode", 0.0)
        self._streams: set[OpenStream] = set()
        self._lock = threading.Lock()
        self.sched = scheduler
        self.grammars = grammars
        self.worker_id = worker_id
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.tokenizer = tokenizer
        self.queue_keepalive_s = queue_keepalive_s
        self.coalesce = coalesce

    def Generate(self, request, context):
        self.drain.refuse_new(context)
        with self.drain.track():
            yield from self._generate(request, context)

    def hand_back(self, unsent_only: bool) -> int:
        """End running streams (with ``unsent_only``, those that sent no token yet) through the
        scheduler (their pages are released as for any abort); each ends with
        :meth:`Drain.hand_back`'s status. Returns how many."""
        with self._lock:
            chosen = [s for s in self._streams if not (unsent_only and s.sent) and not s.handed_back]
            for s in chosen:
                s.handed_back = True
        for s in chosen:
            self.sched.abort_job(s.job, "worker draining: handed back to the router")
        return len(chosen)

    def _generate(self, request, context):
        try:
            job = self.new_job(request)
        except Refused as e:
            context.abort(e.code, e.message)
        stream = OpenStream(job)
        with self._lock:
            self._streams.add(stream)
        try:
            self.sched.submit(job)
            context.add_callback(lambda: job.finish_reason or self.sched.abort_job(job, "decode stream cancelled"))
            try:
                for chunk in stream_chunks(job.out, keepalive_s=self.queue_keepalive_s,
                                           queued=lambda: job.state in QUEUED, coalesce=self.coalesce):
                    yield stream.passing(chunk)
            except StreamEnd as e:
                if stream.handed_back:
                    Drain.hand_back(context, f"decode worker {self.worker_id}")
                context.abort(e.error.code, str(e.error))
        finally:
            with self._lock:
                self._streams.discard(stream)

    def new_job(self, request, out=None) -> DecodeJob:
        """The request validated, as a DecodeJob streaming to ``out`` (default: a SimpleQueue).

        Raises:
            Refused: INVALID_ARGUMENT naming the field, or RESOURCE_EXHAUSTED when it can never
                fit; nothing is allocated.
        """
        try:
            params = validate_request(request.room, request.input_ids, request.sampling,
                                      self.vocab_size, self.max_context)
            if request.local_prefill:  # no prefill leg: nothing of P may be named
                for name in ("prefill_address", "prefill_worker_id"):
                    if getattr(request, name):
                        raise InvalidRequestError(name, "must be empty with local_prefill (D prefills, no P leg)")
            elif not request.prefill_address:
                raise InvalidRequestError("prefill_address", "empty (P's gRPC host:port is needed)")
            if params.stop and self.tokenizer is None:
                raise InvalidRequestError("stop", "stop strings need a tokenizer; this model has none")
            grammar = grammar_state(self.grammars, params)
            n = validate_samples(request.n)
            if n > 1 and request.local_prefill:
                raise InvalidRequestError("n", "n > 1 needs a prefill leg (local_prefill samples one first token)")
            sample_grammars = [grammar_state(self.grammars, params) for _ in range(n - 1)]
        except InvalidRequestError as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        why = self.sched.never_fits(len(request.input_ids), params.max_tokens)
        if why:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
        job = DecodeJob(request_id=request.request_id, room=int(request.room),
                        prompt_ids=list(request.input_ids), params=params,
                        prefill_address=request.prefill_address,
                        prefill_worker_id=request.prefill_worker_id, grammar=grammar,
                        local_prefill=request.local_prefill, n=n, sample_grammars=sample_grammars)
        if out is not None:
            job.out = out
        if params.stop:
            from engine.detokenizer import IncrementalDetokenizer

            job.detok = IncrementalDetokenizer(self.tokenizer, job.prompt_ids, params.stop,
                                               params.skip_special_tokens)
        return job

    def Abort(self, request, context):
        found = self.sched.abort(int(request.room), request.request_id, request.reason or "abort RPC",
                                 request.sample if request.HasField("sample") else None)
        return common_pb2.AbortResponse(found=found)

    def GetLoad(self, request, context):
        try:
            rep = self.sched.load(per_rank=request.per_rank)
        except ServiceError as e:
            context.abort(e.code, str(e))
        rep.worker_id = self.worker_id
        return rep
