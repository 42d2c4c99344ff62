"""Test harness: one decode scheduler in one process (a tiny random-weight model, a stub KV receiver
the test feeds P's notices into, a stub network recording SetDestination / Abort / liveness),
driven step by step by the test playing P. Used by tests/unit/test_decode_*.py.
"""

from __future__ import annotations

import queue
from concurrent.futures import Future
from dataclasses import dataclass

import grpc
import pytest
import torch

from decode_svc.jobs import DecodeJob, DestState, JobState
from decode_svc.messages import DestResult, Notice
from decode_svc.scheduler import DecodeScheduler
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.model_runner import ModelRunner
from engine.models.model_loader import build_model
from engine.sampling_params import SamplingParams
from pd_common.inbox import LoadQuery
from pd_common.head_checksums import head_checksums
from pd_common.protocol import ServiceError
from protos import prefill_pb2
from telemetry import metrics as M

PS = 4
MAX_CONTEXT = 64
P_ADDR = "127.0.0.1:1"
P_SEG, P_INC = "prefill-0", "inc-1"


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(arch="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                      rope_scaling=None, max_position_embeddings=MAX_CONTEXT, tie_word_embeddings=False,
                      attention_bias=False, qk_norm=False, eos_token_ids=(), bos_token_id=None,
                      dtype=torch.float32)
    m = build_model(cfg, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # larger than init_dummy_weights' 0.02, so greedy picks are far from ties
        for name, p in m.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * 0.2)
    return m


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens of the co-located engine (the PD result must match them)."""
    eng = Engine(config=EngineConfig(page_size=PS, num_pages=128, max_running_requests=2,
                                     max_context=MAX_CONTEXT), loaded=(model, None))

    def run(ids, max_tokens):
        out = eng.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return out[0].token_ids

    return run


class StubReceiver:
    """``KVReceiver`` fed by the test."""

    @dataclass
    class Notify:
        sender: str
        payload: bytes

    def __init__(self):
        self.q: queue.SimpleQueue = queue.SimpleQueue()

    def send(self, notice: prefill_pb2.KVNotice, sender: str = P_SEG) -> None:
        self.q.put(self.Notify(sender, notice.SerializeToString()))

    def wait_notify(self, timeout_s: float) -> list:
        out = []
        try:
            out.append(self.q.get(timeout=timeout_s) if timeout_s > 0 else self.q.get_nowait())
            while True:
                out.append(self.q.get_nowait())
        except queue.Empty:
            return out


class StubNet:
    """``PrefillNet`` that records calls; SetDestination is answered with ``reply`` (None: never)."""

    def __init__(self):
        self.post = None
        self.reply: DestState | None = DestState.ACCEPTED
        self.dests: dict[int, prefill_pb2.KVDestination] = {}
        self.aborts: list[tuple] = []
        self.alive_checks: list[set] = []

    def set_destination(self, address, dest, request_id, deadline=None, prefill_worker_id=""):
        assert address == P_ADDR
        self.dests[int(dest.room)] = dest
        if self.reply is not None:
            self.post(DestResult(int(dest.room), self.reply, P_SEG, P_INC))

    def abort(self, address, room, request_id, reason):
        self.aborts.append((address, room, request_id, reason))

    def check_alive(self, peers):
        self.alive_checks.append(set(peers))


class Decode:
    """One D: scheduler, runner, stubs, and the test's side of P."""

    def __init__(self, model, *, num_pages=64, max_running=4, **kw):
        self.runner = ModelRunner(EngineConfig(page_size=PS, num_pages=num_pages, max_running_requests=8,
                                               max_context=MAX_CONTEXT), loaded=(model, None))
        self.recv, self.net = StubReceiver(), StubNet()
        self.sched = DecodeScheduler(self.runner, self.recv, self.net, segment_name="decode-0",
                                     eos_token_ids=[], max_running=max_running, **kw)
        self.net.post = self.sched.post
        self._rooms = iter(range(1, 1 << 20))
        self.jobs: list[DecodeJob] = []

    def submit(self, ids, max_tokens=6, room=None, **sampling) -> DecodeJob:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **sampling)
        room = room or next(self._rooms)
        job = DecodeJob(request_id=f"req-{len(self.jobs)}", room=room, prompt_ids=list(ids),
                        params=params, prefill_address=P_ADDR)
        self.jobs.append(job)
        self.sched.submit(job)
        return job

    def tick(self, n=1) -> None:
        """What the scheduler thread does, ``n`` times (the notice pump included)."""
        for _ in range(n):
            for m in self.recv.wait_notify(0):
                self.sched.post(Notice(m.sender, m.payload))
            self.sched.inbox.drain(0, self.sched.handle)
            self.sched.iterate()
            a = self.sched._load_report().accounting  # mid-flight too (a LoadQuery would settle it)
            assert a.free_pages + a.evictable_pages + a.locked_pages + a.owned_pages == a.total_pages, a

    def run_until_done(self, *jobs, limit=100) -> None:
        for _ in range(limit):
            if all(j.state is JobState.DONE for j in jobs):
                self.tick()  # settle an overlapped step
                return
            self.tick()
        raise AssertionError(f"not done: {[j.state for j in jobs]}")

    def prefill(self, job, first_token, checksums=False, **notice) -> None:
        """Play P: compute the delta's K/V into the destination slots D gave, then notify (with
        checksums of the destination pages when asked)."""
        lease, n = job.lease, len(job.prompt_ids)
        r2t = self.runner.req_to_token_pool.req_to_token
        if n > lease.pre_len:
            slots = r2t[lease.row, lease.pre_len:n]
            batch = ForwardBatch.build(ForwardMode.EXTEND, [lease.row], [lease.pre_len],
                                       [job.prompt_ids[lease.pre_len:]], slots)
            self.runner.forward(batch)
        dst = list(self.net.dests[job.room].dst_page_ids)
        notice.setdefault("pages_sent", len(dst))
        if checksums:
            notice["head_checksums"] = [c for row in head_checksums(self.runner.kv_pool, dst) for c in row]
        self.recv.send(prefill_pb2.KVNotice(room=job.room, ok=True, first_token_id=first_token, **notice))

    def serve(self, ids, max_tokens, reference, checksums=False) -> DecodeJob:
        """One whole request (submit, P's prefill with the co-located first token, decode to the
        end), e.g. to leave its prompt's pages in the radix cache."""
        job = self.submit(ids, max_tokens)
        self.tick()
        self.prefill(job, reference(ids, max_tokens)[0], checksums=checksums)
        self.run_until_done(job)
        return job

    def finish(self, job, ref) -> None:
        """Play P for ``job`` with ``ref``'s first token, decode to the end, and check the stream is
        ``ref`` and ended without error."""
        self.prefill(job, ref[0])
        self.run_until_done(job)
        assert outcome(job) == (ref, None)

    def load(self):
        fut: Future = Future()
        self.sched.handle(LoadQuery(fut))
        return fut.result(timeout=0)

    def assert_idle(self) -> None:
        a = self.load().accounting
        assert a.free_pages + a.evictable_pages + a.locked_pages + a.owned_pages == a.total_pages, a
        assert (a.locked_pages, a.min_lock_ref, a.owned_pages, a.held_rooms, a.held_req_slots) == (0, 0, 0, 0, 0), a
        cache = self.sched.kv.cache
        if cache.enabled:
            cache.check_invariants(num_pages=a.total_pages, free_pages=a.free_pages, expect_unlocked=True)
        for job in self.jobs:  # no room known (gRPC threads would answer Abort found=False)
            assert not self.sched.known.knows(job.room, job.request_id)
            assert not self.sched.known.knows(0, job.request_id)


def chunks(job) -> tuple[list, object]:
    """(DecodeChunks streamed so far, end): end is None (finished), a ServiceError, or "open"."""
    out, end = [], "open"
    while not job.out.empty():
        item = job.out.get()
        if item is None or isinstance(item, ServiceError):
            end = item
        else:
            out.append(item)
    return out, end


def outcome(job) -> tuple[list[int], object]:
    """(tokens streamed so far, end)."""
    got, end = chunks(job)
    return [t for c in got for t in c.token_ids], end


def code(end) -> grpc.StatusCode | None:
    return end.code if isinstance(end, ServiceError) else None


def released(cause: str) -> float:
    """halfmoon_decode_quarantine_releases_total{cause} in this process."""
    return M.DECODE_QUARANTINE_RELEASES.labels(cause=cause)._value.get()


PROMPT = [5, 17, 33, 2, 41, 8, 60, 12, 9, 70]  # 10 tokens: 2 full pages + 2
