"""Tokenization in the router: prompt text / chat messages -> token ids, from the model directory.

Uses the Hugging Face ``transformers`` tokenizer saved with the model (``tokenizer.json``) and the
model's own chat template (``chat_template.jinja`` / ``tokenizer_config.json``). The context window is
``max_position_embeddings`` from ``config.json``, or the smaller cap ``serve-router --max-context``
serves (vLLM's ``--max-model-len``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from engine.config import served_context
from router_svc.tool_calls import tools_system_prompt


@dataclass(frozen=True)
class ModelCard:
    """What the router knows about the served model.

    Attributes:
        id: the model name clients send (``"smollm2-135m-instruct"``).
        path: the Hugging Face directory it was loaded from.
        max_context: context window served, in tokens (prompt + completion): the model's, or the
            ``--max-context`` cap below it. The default ``max_tokens`` is what is left of it.
        vocab_size: number of token ids; valid ids are ``[0, vocab_size)``.
    """

    id: str
    path: Path
    max_context: int
    vocab_size: int


class RouterTokenizer:
    """Encode prompts and chat messages for one model.

    Args:
        model_id: the name clients use for this model.
        model_dir: Hugging Face directory with ``config.json`` and the tokenizer files.
        max_context: the served cap in tokens (``--max-context``), None for the model's window.

    Raises:
        ValueError: ``max_context`` is <= 0 or above the model's window (``engine.config.served_context``).
    """

    def __init__(self, model_id: str, model_dir: Path, max_context: int | None = None) -> None:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        max_ctx = served_context(max_context, int(config.get("max_position_embeddings") or 2048))
        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        vocab = max(int(config.get("vocab_size") or 0), len(self.hf))
        self.card = ModelCard(id=model_id, path=Path(model_dir), max_context=max_ctx, vocab_size=vocab)
        self.backend = self.hf.backend_tokenizer  # tokenizers.Tokenizer: the streamed text's detokenizer
        self._grammars = None

    @property
    def grammars(self):
        """The router's ``engine.grammar.GrammarCompiler`` (built on first use), used to refuse an
        invalid grammar before any worker is asked; workers compile the same spec again."""
        if self._grammars is None:
            from engine.grammar import GrammarCompiler

            eos = [self.hf.eos_token_id] if self.hf.eos_token_id is not None else None
            self._grammars = GrammarCompiler(self.hf, self.card.vocab_size, eos)
        return self._grammars

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Plain-text prompt -> token ids (the tokenizer's own special-token rules, e.g. BOS)."""
        return list(self.hf.encode(text))

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` argument (else tools go in a system block)."""
        return "tools" in (getattr(self.hf, "chat_template", None) or "")

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Chat messages ``[{"role", "content", ["tool_calls"], ["tool_call_id"]}]`` (+ OpenAI
        ``tools``) -> token ids of the templated prompt, ending with the assistant generation prompt.

        A template that does not take ``tools`` gets them as a Hermes system block, and assistant
        tool calls / tool results as ``<tool_call>`` / ``<tool_response>`` text
        (router_svc/tool_calls.py).

        Raises:
            ValueError: the model has no chat template, or the template rejects the messages.
        """
        if not self.has_chat_template:
            raise ValueError("the model has no chat template")
        if self.template_takes_tools:
            text = self.hf.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                               add_generation_prompt=True)
        else:
            text = self.hf.apply_chat_template(_inline_tools(messages, tools), tokenize=False,
                                               add_generation_prompt=True)
        # The template already spells out BOS/role markers: do not add special tokens again.
        return list(self.hf.encode(text, add_special_tokens=False))

    def token_text(self, token_id: int) -> str:
        """The text of one token alone (for logprob entries; may hold U+FFFD for partial bytes)."""
        return self.hf.decode([token_id], skip_special_tokens=False)


def _inline_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages for a template without tool support: tools in the system message, calls and
    results as Hermes text."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                            "arguments": c["function"]["arguments"]})
                               + "\n</tool_call>" for c in m["tool_calls"])
            content = (content + "\n" + calls).strip()
        if m["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": m["role"], "content": content})
    if tools:
        block = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
