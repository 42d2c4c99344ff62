"""Engine: the co-located engine (tokenizer + scheduler + model runner in one process).

Two APIs on one scheduler:

* streaming/step (what a server drives)::

      eng = Engine("smollm2-135m-instruct")
      rid = eng.add_request("Hello", SamplingParams(max_tokens=8, temperature=0))
      while eng.has_unfinished():
          for out in eng.step():            # list[RequestOutput], new tokens/text per request
              print(out.text, end="")

* batch: ``eng.generate(prompts | token-id lists, params) -> list[CompletionOutput]``.

Not thread-safe: one thread owns the engine (a server calls ``add_request``/``abort``/``step`` from
its engine loop and hands outputs to other threads through queues).

Bad requests raise :class:`~engine.errors.InvalidRequestError` (field named) or
:class:`~engine.errors.ResourceExhaustedError` from ``add_request`` before anything is allocated;
the running requests are not affected.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator, Sequence

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.model_runner import ModelRunner
from engine.scheduler.request import FinishReason, Req
from engine.grammar import GrammarCompiler, GrammarState
from engine.sampler import make_generator
from engine.sampling_params import SamplingParams, validate_prompt_ids
from engine.scheduler.scheduler import KVStats, Scheduler


@dataclasses.dataclass
class RequestOutput:
    """What one step produced for one request (deltas), plus running totals."""

    request_id: str
    token_ids: list[int]  # new tokens this step
    text: str  # new text this step (stop strings removed, no split characters)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose K/V came from the radix cache
    logprobs: list[float] | None = None  # per new token, raw-distribution logprob
    top_logprobs: list[list[tuple[int, float]]] | None = None
    stop_str: str | None = None
    error: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    stop_str: str | None = None


class Engine:
    def __init__(self, model: str | None = None, config: EngineConfig | None = None, *,
                 loaded=None, **overrides):
        """``Engine("smollm2-135m-instruct", page_size=4)`` or ``Engine(config=EngineConfig(...))``.

        ``loaded``: ``(model, hf_dir)`` of an already loaded model (``engine.runner.model``,
        ``engine.runner.model_path``) to share weights between engines.
        Raises InvalidRequestError(field="model") for an unknown model name.
        """
        config = dataclasses.replace(config or EngineConfig(), **overrides)
        if model is not None:
            config.model = model
        self.config = config
        self.runner = ModelRunner(config, loaded)
        self.model_config = self.runner.model_config
        self.tokenizer = None
        eos = set(self.model_config.eos_token_ids)
        if self.runner.model_path is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(self.runner.model_path))
            if self.tokenizer.eos_token_id is not None:
                eos.add(self.tokenizer.eos_token_id)
        self.scheduler = Scheduler(self.runner, config, eos)
        self._eos = sorted(eos)
        self._grammars: GrammarCompiler | None = None  # built on the first structured request
        self._detok: dict[str, IncrementalDetokenizer | None] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------------ tokenization
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", "this engine has no tokenizer (dummy weights): pass token ids")
        return self.tokenizer(prompt)["input_ids"]

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Chat messages -> prompt token ids (with the generation prompt)."""
        if self.tokenizer is None:
            raise InvalidRequestError("messages", "this engine has no tokenizer (dummy weights)")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # ------------------------------------------------------------------ step API
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; returns its id.

        Raises (nothing is allocated or queued when they do):
            InvalidRequestError: empty prompt, token ids outside the vocabulary, a bad sampling field.
            ResourceExhaustedError: prompt + max_tokens needs more KV pages than the whole pool.
        """
        params = dataclasses.replace(params) if params is not None else SamplingParams()
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "empty prompt (at least one token is needed)")
            ids = self.encode(prompt)
        else:
            ids = list(prompt)
        validate_prompt_ids(ids, self.model_config.vocab_size)
        params.validate(self.model_config.vocab_size, self.runner.max_context, len(ids))
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._detok:
            raise InvalidRequestError("request_id", f"request id {rid!r} is already in use")
        grammar = self._grammar_state(params)
        gen = None if params.greedy else make_generator(params.seed, self.runner.device)
        req = Req(request_id=rid, prompt_ids=ids, params=params, generator=gen, grammar=grammar)
        self.scheduler.add(req)  # may raise ResourceExhaustedError (nothing queued)
        self._detok[rid] = (IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens)
                            if self.tokenizer is not None else None)
        return rid

    def _grammar_state(self, params: SamplingParams) -> GrammarState | None:
        if params.structured is None:
            return None
        if self.tokenizer is None:
            raise InvalidRequestError(params.structured.field, "structured outputs need a tokenizer (dummy weights)")
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self._eos)
        return self._grammars.state(params.structured)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a queued or running request; returns its final output, or None if unknown."""
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        det = self._detok.pop(request_id, None)
        return self._output(req, [], det.flush() if det else "", None, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """One scheduler step; one RequestOutput per request that produced a token (or failed)."""
        outs = []
        for res in self.scheduler.step():
            req = res.req
            det = self._detok.get(req.request_id)
            if req.error is not None:
                self._detok.pop(req.request_id, None)
                outs.append(self._output(req, [], "", None, None))
                continue
            text = ""
            stop_token = req.finish_reason is FinishReason.STOP  # EOS / stop id: its text is dropped
            if det is not None and not stop_token:
                text = det.add(res.token_id)
                if det.stopped and not req.finished:
                    self.scheduler.finish(req, FinishReason.STOP, det.stop_reason)
            if req.finished:
                if det is not None:
                    text += det.flush()
                self._detok.pop(req.request_id, None)
            lp = [res.logprob] if res.logprob is not None else None
            tops = [res.top_logprobs] if res.top_logprobs is not None else None
            outs.append(self._output(req, [res.token_id], text, lp, tops))
        return outs

    def _output(self, req: Req, toks, text, lp, tops) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, token_ids=toks, text=text, finished=req.finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens or 0, logprobs=lp, top_logprobs=tops, stop_str=req.stop_str,
            error=req.error)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Add one request and step until it finishes, yielding its outputs (others keep running)."""
        rid = self.add_request(prompt, params)
        done = False
        while not done:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    done = out.finished

    # ------------------------------------------------------------------ batch API
    def generate(self, prompts: Sequence[str | Sequence[int]] | str,
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[CompletionOutput]:
        """Run prompts to completion with continuous batching; outputs in input order.

        Validation errors are raised before any request is queued.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError("params", "one SamplingParams per prompt (or a single one)")
        # validate all first so a bad one leaves nothing queued
        all_ids = []
        for p, sp in zip(prompts, plist):
            ids = self.encode(p) if isinstance(p, str) and p else ([] if isinstance(p, str) else list(p))
            validate_prompt_ids(ids, self.model_config.vocab_size)
            (sp or SamplingParams()).validate(self.model_config.vocab_size, self.runner.max_context, len(ids))
            self.scheduler.check_fits(len(ids) + (sp or SamplingParams()).max_tokens)
            all_ids.append(ids)
        rids = [self.add_request(ids, sp) for ids, sp in zip(all_ids, plist)]
        acc = {r: CompletionOutput(r, ids, [], "", None, 0) for r, ids in zip(rids, all_ids)}
        left = set(rids)
        while left:
            for out in self.step():
                c = acc.get(out.request_id)
                if c is None:
                    continue
                c.token_ids += out.token_ids
                c.text += out.text
                if out.logprobs is not None:
                    c.logprobs = (c.logprobs or []) + out.logprobs
                if out.top_logprobs is not None:
                    c.top_logprobs = (c.top_logprobs or []) + out.top_logprobs
                if out.finished:
                    c.finish_reason, c.cached_tokens, c.stop_str = out.finish_reason, out.cached_tokens, out.stop_str
                    left.discard(out.request_id)
        return [acc[r] for r in rids]

    def close(self) -> None:
        """Stop the tensor-parallel ranks of this engine, if any (``EngineConfig.tp_size > 1``)."""
        self.runner.close()

    # ------------------------------------------------------------------ accounting
    def kv_stats(self) -> KVStats:
        """Pages free / evictable / protected (radix) / owned (running requests), rows and slots in use."""
        return self.scheduler.kv_stats()

    def check_invariants(self, expect_idle: bool = False) -> KVStats:
        return self.scheduler.check_invariants(expect_idle)
