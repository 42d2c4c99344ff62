"""The PD protocol's shared pieces, used by both halves of a pair (prefill_svc and decode_svc).

- request validation (before anything is allocated): ids, room, sampling -> InvalidRequestError
  naming the field (services answer INVALID_ARGUMENT);
- proto <-> engine conversions (SamplingParams, TokenLogprob);
- the KV layout a worker publishes (``registry.proto`` KVLayout: "page_major" or "layer_major",
  the pool's ``--kv-layout``).

The notice's KV checksums are ``pd_common.head_checksums``.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.errors import InvalidRequestError
from engine.grammar import GrammarKind, GrammarSpec
from engine.sampling_params import SamplingParams, validate_prompt_ids
from protos import common_pb2, registry_pb2

MAX_ROOM = (1 << 63) - 1
MAX_SAMPLES = 16  # n of one PD request (PrefillRequest.n, DecodeRequest.n); the router's n / best_of bound


class ServiceError(Exception):
    """A request ended with a gRPC status: ``code`` (grpc.StatusCode) and the message."""

    def __init__(self, code, message: str):
        self.code = code
        super().__init__(message)


def _top_k(v: int) -> int:
    return -1 if v == 0 else int(v)  # proto 0 = engine -1 (off); < -1 is rejected by validate()


# Optional SamplingParams fields: (name, conversion) of those copied when set; unset ones keep the
# engine defaults
_OPTIONAL_FIELDS = (("temperature", float), ("top_p", float), ("top_k", _top_k), ("min_p", float),
                    ("seed", int), ("repetition_penalty", float), ("frequency_penalty", float),
                    ("presence_penalty", float), ("max_tokens", int))


def sampling_from_proto(sp: common_pb2.SamplingParams) -> SamplingParams:
    """Proto -> engine SamplingParams; unset optional fields take the engine defaults."""
    p = SamplingParams()
    for name, conv in _OPTIONAL_FIELDS:
        if sp.HasField(name):
            setattr(p, name, conv(getattr(sp, name)))
    p.stop = list(sp.stop)
    p.stop_token_ids = [int(t) for t in sp.stop_token_ids]
    p.ignore_eos = bool(sp.ignore_eos)
    p.logprobs = bool(sp.logprobs)
    p.top_logprobs = int(sp.top_logprobs)
    p.logit_bias = {int(t): float(b) for t, b in sp.logit_bias.items()}
    p.structured = structured_from_proto(sp)
    return p


def structured_from_proto(sp: common_pb2.SamplingParams) -> GrammarSpec | None:
    """``sampling.structured`` -> GrammarSpec (errors name "structured"), None when unset.

    Raises:
        InvalidRequestError: "structured" set with no kind, or ``json_object: false``.
    """
    if not sp.HasField("structured"):
        return None
    which = sp.structured.WhichOneof("kind")
    if which is None or (which == "json_object" and not sp.structured.json_object):
        raise InvalidRequestError("structured", "set but names no grammar (json_schema, json_object, regex, ebnf)")
    source = "" if which == "json_object" else getattr(sp.structured, which)
    return GrammarSpec(GrammarKind(which), source)


def validate_request(room: int, input_ids: Sequence[int], sampling: common_pb2.SamplingParams,
                     vocab_size: int, max_context: int) -> SamplingParams:
    """Check one PD request; returns its engine SamplingParams.

    Raises:
        InvalidRequestError: field "room" (0 or above 2**63-1), "input_ids" (empty, or an id outside
            [0, vocab_size)), or the sampling field at fault (see ``SamplingParams.validate``; a
            prompt that leaves no room for max_tokens in ``max_context`` names "max_tokens", an
            over-long prompt alone names "input_ids").
    """
    if not 0 < room <= MAX_ROOM:
        raise InvalidRequestError("room", f"must be in [1, 2**63-1], got {room}")
    ids = list(input_ids)
    validate_prompt_ids(ids, vocab_size, field="input_ids")
    if len(ids) >= max_context:
        raise InvalidRequestError("input_ids", f"prompt of {len(ids)} tokens does not fit the context "
                                               f"window of {max_context} tokens")
    params = sampling_from_proto(sampling)
    params.validate(vocab_size, max_context, len(ids))
    return params


def validate_samples(n: int) -> int:
    """``PrefillRequest.n`` / ``DecodeRequest.n`` -> the number of samples (0 means 1).

    Raises:
        InvalidRequestError: field "n", above ``MAX_SAMPLES``.
    """
    if n > MAX_SAMPLES:
        raise InvalidRequestError("n", f"must be in [1, {MAX_SAMPLES}] (0 = 1), got {n}")
    return max(1, int(n))


def token_logprob(token_id: int, logprob: float | None,
                  top: list[tuple[int, float]] | None) -> common_pb2.TokenLogprob:
    msg = common_pb2.TokenLogprob(token_id=int(token_id), logprob=float(logprob or 0.0))
    for t, lp in top or ():
        msg.top.add(token_id=int(t), logprob=float(lp))
    return msg


def kv_layout(kv_pool, model: str, tp_size: int = 1, kv_heads: int | None = None,
              max_context: int = 0) -> registry_pb2.KVLayout:
    """The KVLayout of an ``engine.kvcache.kv_pool.KVPool``, in the pool's own layout.

    page_major: ``buffer_addrs`` = [the one region], ``page_stride_bytes`` = a whole page (every
    layer's K and V, ``2 * num_layers * page_bytes``); layer_major: ``buffer_addrs`` = [K_0, V_0, K_1,
    ...], ``page_stride_bytes`` = ``page_bytes``. ``page_bytes`` is one page of one layer's K or V.
    Under tensor parallelism (``tp_size`` > 1, ``kv_heads`` the model's kv heads while this pool,
    rank 0's, holds only its own) ``kv_heads``, ``page_bytes`` and ``page_stride_bytes`` are those of
    every kv head (registry.proto KVLayout.tp_size).
    ``max_context``: the tokens per request the worker serves (``--max-context``), 0 = not said.
    """
    bufs = kv_pool.buffers()
    heads = kv_heads or kv_pool.num_kv_heads
    return registry_pb2.KVLayout(
        layout=kv_pool.layout, num_layers=kv_pool.num_layers, page_size=kv_pool.page_size,
        num_pages=kv_pool.num_pages, kv_heads=heads, head_dim=kv_pool.head_dim,
        dtype=str(kv_pool.dtype).removeprefix("torch."),
        buffer_addrs=[b.data_ptr() for b in bufs], page_bytes=kv_pool.page_bytes // kv_pool.num_kv_heads * heads,
        page_stride_bytes=kv_pool.page_stride_bytes // kv_pool.num_kv_heads * heads, model=model,
        tp_size=tp_size if tp_size > 1 else 0, max_context=max_context)


def published_layout(runner, model: str) -> registry_pb2.KVLayout:
    """The KVLayout a worker publishes for ``runner`` (an ``engine.model_runner.ModelRunner``): its
    pool's, over every rank's kv heads when it runs tensor-parallel."""
    if runner.tp is None:
        return kv_layout(runner.kv_pool, model, max_context=runner.max_context)
    return kv_layout(runner.kv_pool, model, runner.tp.size, runner.model_config.num_kv_heads,
                     runner.max_context)
