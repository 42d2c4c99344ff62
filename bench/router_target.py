"""Benchmark target: the halfmoon router over gRPC (``halfmoon.v1.Router.Generate``, streaming).

Each :class:`~protos.router_pb2.GenerateResponse` carries the new output ``token_ids``, so chunk token
counts (and ITL) are exact; the last one carries ``usage`` (prompt / completion / cached tokens,
decode prefix tokens, KV pages and bytes transferred) and the workers that served the request.
"""

from __future__ import annotations

import dataclasses
import time

import grpc

from bench.request import BenchRequest, RequestRecord
from protos import common_pb2, router_pb2, router_pb2_grpc
from security.call_metadata import aio_bearer_channel

_MAX_MSG = 64 * 1024 * 1024


def to_proto(req: BenchRequest, model: str = "") -> router_pb2.GenerateRequest:
    """The GenerateRequest for ``req``: chat messages, else token ids, else text."""
    sp = common_pb2.SamplingParams(temperature=req.temperature, max_tokens=req.max_tokens,
                                   ignore_eos=req.ignore_eos, stop=list(req.stop))
    msg = router_pb2.GenerateRequest(model=model, sampling=sp)
    if req.messages is not None:
        msg.chat.CopyFrom(router_pb2.ChatMessages(
            messages=[router_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in req.messages]))
    elif req.prompt_ids is not None:
        msg.token_ids.CopyFrom(router_pb2.TokenIds(ids=req.prompt_ids))
    elif req.prompt is not None:
        msg.text = req.prompt
    else:
        raise ValueError("request has no messages, prompt_ids or prompt")
    return msg


class RouterTarget:
    """Streams requests to a router at ``address`` (``host:port``) over one shared gRPC channel.

    Args:
        address: router gRPC address.
        model: model name to ask for ("" = the router's served model).
        send_text: send ``prompt`` text even when ``prompt_ids`` are known (the router tokenizes).
        timeout_s: per-request deadline (seconds).
        api_key: the router's API key, sent as ``authorization: Bearer`` (None: none).
    """

    name = "router"

    def __init__(self, address: str, model: str = "", send_text: bool = False, timeout_s: float = 600.0,
                 api_key: str | None = None):
        self.address = address
        self.api_key = api_key
        self.model = model
        self.send_text = send_text
        self.timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: router_pb2_grpc.RouterStub | None = None

    async def start(self) -> None:
        opts = [("grpc.max_receive_message_length", _MAX_MSG), ("grpc.max_send_message_length", _MAX_MSG)]
        self._channel = aio_bearer_channel(self.address, self.api_key, options=opts)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def served_model(self) -> str:
        """The first model the router lists (ListModels)."""
        assert self._stub is not None, "start() first"
        resp = await self._stub.ListModels(router_pb2.ListModelsRequest(), timeout=30)
        return resp.models[0].id if resp.models else ""

    async def generate(self, req: BenchRequest) -> RequestRecord:
        """Send ``req``, stream the answer, return what was measured (errors are recorded, not raised)."""
        assert self._stub is not None, "start() first"
        rec = RequestRecord(session_id=req.session_id, turn=req.turn, group=req.group, tag=req.tag)
        send = req
        if self.send_text and req.prompt is not None and req.messages is None:
            send = dataclasses.replace(req, prompt_ids=None)
        msg = to_proto(send, self.model)
        texts: list[str] = []
        rec.start = time.perf_counter()
        call = self._stub.Generate(msg, timeout=self.timeout_s)
        try:
            async for resp in call:
                now = time.perf_counter()
                if resp.token_ids:
                    rec.chunk_times.append(now)
                    rec.chunk_tokens.append(len(resp.token_ids))
                    rec.token_ids.extend(resp.token_ids)
                    if req.stop_after is not None and len(rec.token_ids) >= req.stop_after:
                        call.cancel()  # the router aborts both legs; D frees the request's KV
                        rec.finish_reason = "client_stop"
                        rec.completion_tokens = len(rec.token_ids)
                        break
                texts.append(resp.text)
                if resp.finish_reason:
                    rec.finish_reason = resp.finish_reason
                if resp.HasField("usage"):
                    u = resp.usage
                    rec.prompt_tokens, rec.completion_tokens = u.prompt_tokens, u.completion_tokens
                    rec.cached_tokens, rec.decode_prefix_tokens = u.cached_tokens, u.decode_prefix_tokens
                    rec.kv_pages_transferred = u.kv_pages_transferred
                    rec.kv_bytes_transferred = u.kv_bytes_transferred
                if resp.prefill_worker:
                    rec.prefill_worker = resp.prefill_worker
                if resp.decode_worker:
                    rec.decode_worker = resp.decode_worker
            rec.ok = bool(rec.finish_reason)
            if not rec.ok:
                rec.error = "stream ended without a finish_reason"
        except grpc.aio.AioRpcError as e:
            rec.error = f"{e.code().name}: {e.details()}"
        rec.end = time.perf_counter()
        rec.text = "".join(texts)
        return rec
