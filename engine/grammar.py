"""Structured outputs: a grammar (JSON Schema, any JSON object, regex, EBNF) every sampled token must
keep the output inside, enforced with xgrammar token bitmasks.

Why xgrammar (over llguidance): it is what vLLM and SGLang ship by default, it has a torch
``apply_token_bitmask_inplace`` for CPU and CUDA logits (so the mask is applied on the device), a
thread-safe compiler with a compiled-grammar cache keyed by the grammar text, and JSON Schema,
regex and EBNF front ends behind one ``CompiledGrammar``. llguidance is as fast to mask and has
no per-schema compile step, but its Python surface is lower level (Lark grammars, a separate
torch helper) and it is not used by default in SGLang; either would do.

One :class:`GrammarCompiler` per process and tokenizer; compiling the same spec twice hits its
cache. One :class:`GrammarState` per request: the matcher that tracks the output so far.

PD: P's state constrains the first token; D builds a fresh state from the same spec and replays
P's first token into it (``accept``) when the notice commits. The matcher is a deterministic
function of (grammar, accepted tokens), so the replay gives exactly P's state without shipping it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import threading

import torch

from engine.errors import InvalidRequestError

# the JSON shape of the output: compact separators, no free whitespace (a small model given
# "any whitespace" tends to emit newlines until max_tokens)
_JSON_OPTS = dict(any_whitespace=False)
MAX_GRAMMAR_CHARS = 65536  # a longer schema / regex / grammar is refused (compile time and memory)


class GrammarKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"  # source: a JSON Schema document (JSON text)
    JSON_OBJECT = "json_object"  # source unused: any JSON object
    REGEX = "regex"              # source: the regex the whole output matches
    EBNF = "ebnf"                # source: an EBNF (GBNF) grammar with a "root" rule


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match. ``field`` names the request field in errors."""

    kind: GrammarKind
    source: str = ""
    field: str = "structured"


class GrammarState:
    """One request's matcher: which tokens may come next, given the tokens accepted so far."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 [B, ceil(V / 32)], CPU)."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False when the grammar does not allow it."""
        return bool(self._m.accept_token(int(token_id)))

    @property
    def terminated(self) -> bool:
        """True once the grammar is complete and its stop token was accepted."""
        return bool(self._m.is_terminated())


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` for one tokenizer, each distinct spec once (xgrammar's cache).

    Args:
        hf_tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's length: padding ids are
            never allowed).
        stop_token_ids: the ids that end a complete output (the model's EOS ids).
    """

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None) -> None:
        # built on the first structured request: building the tokenizer table takes a while, and a
        # worker without xgrammar installed still serves every other request
        self._hf, self._stop = hf_tokenizer, stop_token_ids
        self._lock = threading.Lock()
        self._xgr = None
        self._compiler = None
        self.vocab_size = vocab_size

    def _built(self):
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError as exc:
                    raise InvalidRequestError("structured", "structured output needs the xgrammar "
                                                            "package on this worker") from exc
                info = xgr.TokenizerInfo.from_huggingface(self._hf, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop or None)
                self._xgr = xgr
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
            return self._compiler

    def compile(self, spec: GrammarSpec):
        """-> xgrammar CompiledGrammar.

        Raises:
            InvalidRequestError: ``spec.field``, when the schema / regex / grammar does not parse,
                uses what xgrammar cannot enforce, or is longer than ``MAX_GRAMMAR_CHARS``.
        """
        if len(spec.source) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(spec.field, f"{spec.kind.value} of {len(spec.source)} characters exceeds "
                                                  f"{MAX_GRAMMAR_CHARS}")
        c = self._built()
        try:
            if spec.kind is GrammarKind.JSON_OBJECT:
                return c.compile_json_schema('{"type": "object"}', **_JSON_OPTS)
            if spec.kind is GrammarKind.JSON_SCHEMA:
                schema = json.loads(spec.source)
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("a JSON Schema is an object (or a boolean)")
                return c.compile_json_schema(spec.source, **_JSON_OPTS)
            if spec.kind is GrammarKind.REGEX:
                if not spec.source:
                    raise ValueError("empty regex")
                return c.compile_regex(spec.source)
            if spec.kind is GrammarKind.EBNF:
                return c.compile_grammar(spec.source)
        except InvalidRequestError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError for bad input
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidRequestError(spec.field, f"invalid {spec.kind.value}: {msg[:300]}") from exc
        raise InvalidRequestError(spec.field, f"unknown grammar kind {spec.kind!r}")

    def state(self, spec: GrammarSpec) -> GrammarState:
        """A fresh matcher for one request (raises like :meth:`compile`)."""
        compiled = self.compile(spec)  # builds the compiler (and self._xgr) on first use
        return GrammarState(self._xgr.GrammarMatcher(compiled), self.vocab_size)


def apply_grammars(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Mask, in place, every token ``states[j]`` forbids in ``logits[rows[j]]`` (float [B, V]).

    The bitmask is filled on the host (the matcher is CPU code) and applied where the logits are:
    xgrammar's kernel on CUDA, its CPU kernel otherwise.
    """
    import xgrammar as xgr

    V = logits.shape[-1]
    mask = xgr.allocate_token_bitmask(logits.shape[0], V)
    for r, st in zip(rows, states):
        st.fill(mask, r)
    xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True), vocab_size=V, indices=rows)
