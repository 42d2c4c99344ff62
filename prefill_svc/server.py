"""Prefill gRPC servicer: validates, hands work to the scheduler thread, waits for the result.

RPCs (protos/prefill.proto): ``Prefill`` (blocks until the KV is written and the notice is
delivered, or the job fails), ``SetDestination`` (from D; may arrive before ``Prefill``),
``Abort``, ``GetLoad``. Bad input -> INVALID_ARGUMENT naming the field, before anything is
allocated; a prompt that can never fit the pool -> RESOURCE_EXHAUSTED. A cancelled ``Prefill``
call (router/client gone) aborts its job.
"""

from __future__ import annotations

import time

import grpc

from engine.errors import InvalidRequestError
from engine.grammar import GrammarCompiler
from pd_common.drain import Drain
from pd_common.protocol import MAX_ROOM, ServiceError, validate_request, validate_samples
from pd_common.tokenizer import grammar_state
from prefill_svc.destinations import tombstone_error
from prefill_svc.jobs import Destination, PrefillJob
from prefill_svc.kv_runs import PoolGeometry
from prefill_svc.scheduler import PrefillScheduler
from protos import common_pb2, prefill_pb2, prefill_pb2_grpc

class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """Args: scheduler; transfer: the worker's ``TransferEngine`` (its segment name and incarnation
    answer SetDestination); vocab_size, max_context: the model's, for request validation;
    grammars: the worker's grammar compiler (None: structured requests are refused); drain: the
    worker's drain state (pd_common/drain.py; default: never draining)."""

    def __init__(self, scheduler: PrefillScheduler, transfer, worker_id: str, *,
                 vocab_size: int, max_context: int, grammars: GrammarCompiler | None = None,
                 drain: Drain | None = None):
        self.drain = drain or Drain("prefill", 0.0)
        self.sched = scheduler
        self.grammars = grammars
        self.transfer = transfer
        self.worker_id = worker_id
        self.vocab_size = vocab_size
        self.max_context = max_context

    def Prefill(self, request, context):
        self.drain.refuse_new(context)
        with self.drain.track():
            return self._prefill(request, context)

    def _prefill(self, request, context):
        try:
            params = validate_request(request.room, request.input_ids, request.sampling,
                                      self.vocab_size, self.max_context)
            grammar = grammar_state(self.grammars, params)
            n = validate_samples(request.n)
            sample_grammars = [grammar_state(self.grammars, params) for _ in range(n - 1)]
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        why = self.sched.never_fits(len(request.input_ids))
        if why:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
        job = PrefillJob(request_id=request.request_id, room=int(request.room),
                         prompt_ids=list(request.input_ids), params=params, grammar=grammar,
                         n=n, sample_grammars=sample_grammars)
        remaining = context.time_remaining()
        if remaining is not None:  # the caller's deadline bounds the wait for D's destination
            job.destination_deadline = job.arrived + remaining
        fut = self.sched.submit(job)
        context.add_callback(lambda: fut.done() or self.sched.abort_job(job, "prefill call cancelled"))
        try:
            return fut.result()
        except ServiceError as e:
            context.abort(e.code, str(e))

    def SetDestination(self, request, context):
        received = time.monotonic()  # the write window counts from here (docs: Fencing one-sided writes)
        if not 0 < request.room <= MAX_ROOM:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"room: must be in [1, 2**63-1], got {request.room}")
        if not request.decode_segment:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "decode_segment: empty")
        if request.prefill_incarnation and request.prefill_incarnation != self.transfer.incarnation:
            # meant for another start of this worker: D ties the pages to that start's life
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"prefill_incarnation: {request.prefill_incarnation!r} is not this start of "
                          f"{self.transfer.name} ({self.transfer.incarnation!r})")
        refused = self.sched.book.refusal(int(request.room))
        if refused:
            context.abort(refused.code, str(refused))
        try:
            seg = self.sched.open_segment(request.decode_segment)
        except Exception as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"decode_segment: cannot open {request.decode_segment!r}: {e}")
        geom = PoolGeometry.from_layout(seg.kv_layout)
        window_ms = request.write_deadline_ms
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:  # D counts its fence from its own deadline
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "SetDestination arrived past its deadline")
        not_after = received + window_ms / 1000 if window_ms else None
        why = self.sched.offer_destination(Destination(request, seg, geom, not_after))
        if why and why != "duplicate":
            refused = tombstone_error(int(request.room), why)
            context.abort(refused.code, str(refused))
        if why:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"room {request.room}: {why} destination")
        return prefill_pb2.SetDestinationResponse(prefill_segment=self.transfer.name,
                                                  incarnation=self.transfer.incarnation,
                                                  write_deadline_ms=window_ms)

    def Abort(self, request, context):
        found = self.sched.abort(int(request.room), request.request_id, request.reason or "abort RPC")
        return common_pb2.AbortResponse(found=found)

    def GetLoad(self, request, context):
        try:
            rep = self.sched.load(per_rank=request.per_rank)
        except ServiceError as e:
            context.abort(e.code, str(e))
        rep.worker_id = self.worker_id
        return rep
