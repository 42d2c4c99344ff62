"""The worker's text side: its model's tokenizer and the grammar compiler built on it.

P needs the compiler to constrain the first token of a structured request, D to constrain the
rest (and its stop strings need the tokenizer). Both compile with the same tokenizer, logits width
and stop ids, so a grammar allows the same tokens on both.
"""

from __future__ import annotations

import os

from engine.errors import InvalidRequestError
from engine.grammar import GrammarCompiler, GrammarState
from engine.sampling_params import SamplingParams


def load_tokenizer(runner, model: str):
    """The model's Hugging Face tokenizer, or None. With ``--load-format dummy`` and a model
    directory (config.json + tokenizer files, no weights) it comes from that directory."""
    path = runner.model_path
    if path is None and os.path.isfile(os.path.join(os.path.expanduser(model), "tokenizer.json")):
        path = os.path.expanduser(model)
    if path is None:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except Exception:
        return None


def grammar_compiler(runner, tokenizer) -> GrammarCompiler | None:
    """The worker's compiler (None without a tokenizer: structured requests are then refused)."""
    if tokenizer is None:
        return None
    return GrammarCompiler(tokenizer, runner.vocab_size, list(runner.model_config.eos_token_ids))


def grammar_state(compiler: GrammarCompiler | None, params: SamplingParams) -> GrammarState | None:
    """A fresh matcher for a structured request, None for an unconstrained one.

    Raises:
        InvalidRequestError: "structured", when the grammar is invalid or this worker has no tokenizer.
    """
    if params.structured is None:
        return None
    if compiler is None:
        raise InvalidRequestError("structured", "structured outputs need the model's tokenizer; this worker has none")
    return compiler.state(params.structured)
