"""Incremental detokenizer: token ids in, text deltas out, never a split UTF-8 character, with
stop strings cut out.

Text of new tokens is found by decoding a short window ``ids[prefix_offset:]`` and subtracting the
decode of ``ids[prefix_offset:read_offset]`` (the method of TGI / vLLM ``detokenize_incrementally``):
decoding a window that starts a few tokens back keeps word-initial spaces right, and a window whose
text ends in U+FFFD (an incomplete UTF-8 sequence) is held until the next token completes it.

Stop strings: text that could still be the start of a stop string (the last ``max(len(stop)) - 1``
characters) is held back; when a stop string appears, the text is cut before it and ``stopped``
turns True. :meth:`flush` releases held text when the request ends for another reason.
"""

from __future__ import annotations

from typing import Sequence

CONTEXT_TOKENS = 5  # prompt tokens to seed the window with (so the first output token's space is kept)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # output text so far (stop string and what follows removed once stopped)
        self.emitted = 0  # chars of self.text already returned
        self.stopped = False
        self.stop_reason: str | None = None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the text now safe to emit ("" while held back)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._append(full[len(prefix):])
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._take(final=False)

    def _append(self, delta: str) -> None:
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.text = self.text[: best[0]]
            self.stopped = True
            self.stop_reason = best[1]

    def _take(self, final: bool) -> str:
        end = len(self.text) if (final or self.stopped) else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out

    def flush(self) -> str:
        """The request ended (length, EOS, stop token, abort): return everything still held,
        including an incomplete trailing character's decode (as U+FFFD)."""
        if not self.stopped and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix):
                self._append(full[len(prefix):])
            self.prefix_offset = self.read_offset = len(self.ids)
        return self._take(final=True)
