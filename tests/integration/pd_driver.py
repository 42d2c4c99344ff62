"""Test driver for one prefill/decode pair, calling the services over gRPC exactly like the router.

For each request: mint a random 63-bit room (``secrets.randbits(63)``, never 0), then call
``D.Generate`` (server stream) and ``P.Prefill`` concurrently, DecodeRequest carrying P's address.
If the prefill leg fails before the first token the decode stream is cancelled, and vice versa.

    drv = PDDriver(prefill_addr, decode_addr)
    res = drv.generate([1, 2, 3], max_tokens=8)          # PDResult
    results = drv.generate_many(prompts, concurrency=8, max_tokens=8)
"""

from __future__ import annotations

import secrets
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc


@dataclass
class PDResult:
    """Outcome of one request through P and D.

    tokens: every output token id (P's first token included), in order.
    finish_reason: "stop" | "length" | "abort" | "" (stream broke before a finish).
    decode_error / prefill_error: (grpc.StatusCode name, details) of a failed leg, else None.
    chunks: the DecodeChunk messages as received, D's keepalives (empty chunks) left out;
    keepalives: for each keepalive, how many tokens had arrived before it.
    prefill: the PrefillResult (or None).
    """

    request_id: str
    room: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str = ""
    matched_stop: str = ""
    chunks: list = field(default_factory=list)
    keepalives: list[int] = field(default_factory=list)
    prefill: object | None = None
    decode_error: tuple[str, str] | None = None
    prefill_error: tuple[str, str] | None = None

    @property
    def ok(self) -> bool:
        return self.decode_error is None and self.finish_reason in ("stop", "length")

    @property
    def last(self):
        return self.chunks[-1] if self.chunks else None


def sampling(max_tokens: int = 8, **kw) -> common_pb2.SamplingParams:
    """SamplingParams with greedy decoding (temperature 0) unless overridden."""
    kw.setdefault("temperature", 0.0)
    return common_pb2.SamplingParams(max_tokens=max_tokens, **kw)


class PDDriver:
    """Drives requests through one P and one D over gRPC (channels are reused).

    ``prefill_worker_id``: P's worker id, sent in every DecodeRequest as the router sends it; with
    it D can prove P's death (and free the pages P might write) before P answered SetDestination,
    without it only P's answer or the fence deadline (minutes) releases them."""

    def __init__(self, prefill_addr: str, decode_addr: str, timeout_s: float = 120.0, prefill_worker_id: str = ""):
        self.prefill_addr = prefill_addr
        self.decode_addr = decode_addr
        self.timeout_s = timeout_s
        self.prefill_worker_id = prefill_worker_id
        self._p_chan = grpc.insecure_channel(prefill_addr)
        self._d_chan = grpc.insecure_channel(decode_addr)
        self.prefill = prefill_pb2_grpc.PrefillStub(self._p_chan)
        self.decode = decode_pb2_grpc.DecodeStub(self._d_chan)

    def close(self) -> None:
        self._p_chan.close()
        self._d_chan.close()

    # ------------------------------------------------------------------ one request
    def start(self, input_ids, params: common_pb2.SamplingParams | None = None, *,
              room: int | None = None, request_id: str | None = None,
              send_prefill: bool = True, send_decode: bool = True) -> "PDCall":
        """Start both legs; returns a PDCall to wait on or cancel."""
        room = (secrets.randbits(63) or 1) if room is None else room
        request_id = request_id or uuid.uuid4().hex[:16]
        params = params or sampling()
        call = PDCall(self, request_id, room)
        if send_decode:
            dreq = decode_pb2.DecodeRequest(request_id=request_id, room=room, input_ids=list(input_ids),
                                            sampling=params, prefill_address=self.prefill_addr,
                                            prefill_worker_id=self.prefill_worker_id)
            call._stream = self.decode.Generate(dreq, timeout=self.timeout_s)
        if send_prefill:
            preq = prefill_pb2.PrefillRequest(request_id=request_id, room=room,
                                              input_ids=list(input_ids), sampling=params)
            call._pfut = self.prefill.Prefill.future(preq, timeout=self.timeout_s)
            call._pfut.add_done_callback(call._on_prefill_done)
        if call._stream is not None:
            call._reader = threading.Thread(target=call._consume, daemon=True)
            call._reader.start()
        return call

    def generate(self, input_ids, max_tokens: int = 8, params=None, **kw) -> PDResult:
        params = params or sampling(max_tokens)
        return self.start(input_ids, params, **kw).wait()

    def generate_many(self, prompts, max_tokens: int = 8, concurrency: int = 8,
                      params=None) -> list[PDResult]:
        """Run ``prompts`` (lists of ids) with up to ``concurrency`` in flight; results in order."""
        with ThreadPoolExecutor(concurrency) as ex:
            return list(ex.map(lambda p: self.generate(p, max_tokens, params=params), prompts))

    def abort(self, room: int, request_id: str = "", *, prefill: bool = True,
              decode: bool = True) -> tuple[bool, bool]:
        """Abort RPC on both legs; returns (found on P, found on D)."""
        req = common_pb2.AbortRequest(request_id=request_id, room=room, reason="test")
        fp = self.prefill.Abort(req, timeout=10).found if prefill else False
        fd = self.decode.Abort(req, timeout=10).found if decode else False
        return fp, fd


class PDCall:
    """One in-flight request through P and D."""

    def __init__(self, driver: PDDriver, request_id: str, room: int):
        self.driver = driver
        self.result = PDResult(request_id=request_id, room=room)
        self._stream = None
        self._reader = None
        self._pfut = None
        self._first = threading.Event()

    def _on_prefill_done(self, fut) -> None:
        try:
            self.result.prefill = fut.result()
        except grpc.RpcError as e:
            self.result.prefill_error = (e.code().name, e.details() or "")
            if not self._first.is_set() and self._stream is not None:
                self._stream.cancel()  # like the router: a failed leg before the first token
        except grpc.FutureCancelledError:
            self.result.prefill_error = ("CANCELLED", "cancelled by the driver")

    def first_chunk(self, timeout: float | None = None) -> bool:
        return self._first.wait(timeout)

    def cancel(self) -> None:
        """Client cancel: cancel both RPCs (the services see the cancellation)."""
        if self._stream is not None:
            self._stream.cancel()
        if self._pfut is not None:
            self._pfut.cancel()

    def _consume(self) -> None:
        r = self.result
        try:
            for chunk in self._stream:
                if chunk == decode_pb2.DecodeChunk():  # a keepalive: the request is queued in D
                    r.keepalives.append(len(r.tokens))
                    continue
                r.chunks.append(chunk)
                r.tokens.extend(chunk.token_ids)
                r.logprobs.extend(chunk.logprobs)
                if chunk.finish_reason:
                    r.finish_reason = chunk.finish_reason
                    r.matched_stop = chunk.matched_stop
                self._first.set()
        except grpc.RpcError as e:
            r.decode_error = (e.code().name, e.details() or "")
            if self._pfut is not None and not self._pfut.done():
                self._pfut.cancel()

    def wait(self) -> PDResult:
        r = self.result
        if self._stream is not None:
            self._reader.join()
        if self._pfut is not None:
            try:
                self._pfut.result(timeout=self.driver.timeout_s)
            except Exception:  # recorded by the callback
                pass
            # the done-callback may still be running; give it a moment to record the outcome
            for _ in range(100):
                if r.prefill is not None or r.prefill_error is not None:
                    break
                threading.Event().wait(0.01)
        return r


# ---------------------------------------------------------------------- references
def colocated_generate(prompts, max_tokens: int, *, page_size: int = 16, model: str | None = None,
                       num_pages: int = 2048, chunked_prefill_size: int = 2048,
                       first_alone: bool = False) -> list[list[int]]:
    """Greedy output ids of the co-located engine (engine.scheduler.scheduler.Scheduler), all prompts batched
    (with ``first_alone``, the first prompt runs to completion first, so its prefix is cached)."""
    import torch

    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    from engine.scheduler.request import Req
    from engine.sampling_params import SamplingParams
    from engine.scheduler.scheduler import Scheduler

    torch.set_num_threads(1)
    cfg = EngineConfig(model=model or "smollm2-135m-instruct", page_size=page_size,
                       num_pages=num_pages, torch_threads=1, max_running_requests=64,
                       chunked_prefill_size=chunked_prefill_size)
    runner = ModelRunner(cfg)
    sched = Scheduler(runner, cfg, set(runner.model_config.eos_token_ids))
    reqs = [Req(str(i), list(p), SamplingParams(max_tokens=max_tokens, temperature=0.0), None)
            for i, p in enumerate(prompts)]
    waves = [reqs[:1], reqs[1:]] if first_alone else [reqs]
    for wave in waves:
        for r in wave:
            sched.add(r)
        while sched.has_work():
            sched.step()
    return [list(r.output_ids) for r in reqs]


def transformers_generate(prompts, max_tokens: int, model: str | None = None) -> list[list[int]]:
    """Greedy output ids from Hugging Face transformers (fp32, CPU), one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.model_store import resolve_model

    path = resolve_model(model or "smollm2-135m-instruct")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([list(p)])
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                            do_sample=False, num_beams=1)
            out.append(g[0, len(p):].tolist())
    return out


def check_transferred_pages(records: list[dict], result: PDResult, page_size: int,
                            descriptors_per_run: int | None = None) -> tuple[int, int]:
    """Assert P sent exactly logical pages [pre_len/ps, ceil(len/ps)) of this request, each once,
    to distinct destination pages, and (when ``descriptors_per_run`` is given) that each batch had
    that many descriptors (puts) per page run: 1 for page_major pools, 2 * layers for layer_major.
    Returns (pages, bytes) transferred."""
    first = result.chunks[0]
    pre, n = first.decode_prefix_tokens, first.prompt_tokens
    batches = [r for r in records if r.get("room") == result.room and r["event"] == "batch"]
    logical = [p for b in batches for p in b["logical_pages"]]
    dst = [p for b in batches for p in b["dst_pages"]]
    want = list(range(pre // page_size, -(-n // page_size)))
    assert sorted(logical) == want and len(logical) == len(set(logical)), (logical, want)
    assert len(set(dst)) == len(dst)
    assert all(b["pre_len"] == pre for b in batches)
    if descriptors_per_run is not None:
        assert all(b["descriptors"] == descriptors_per_run * len(b["runs"]) for b in batches), batches
    notices = [r for r in records if r.get("room") == result.room and r["event"] == "notice"]
    assert len(notices) == 1 and notices[0]["ok"] and notices[0]["pages_sent"] == len(want), notices
    assert first.kv_pages_transferred == len(want)
    return len(want), sum(b["bytes"] for b in batches)
