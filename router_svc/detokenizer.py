"""Streaming detokenization: token ids arrive a few at a time; text deltas go out.

Two guarantees for every delta emitted:

1. It never splits a multi-byte UTF-8 character: ``tokenizers.decoders.DecodeStream`` holds bytes
   back until they decode (byte-level BPE splits e.g. an emoji over several tokens).
2. It never contains any part of a stop string: text that could still grow into a stop string is held
   back until it cannot, and once a stop string appears the text is cut right before it (OpenAI
   semantics: the stop string is not returned).
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class StreamDetokenizer:
    """Incremental detokenizer with stop-string handling for one request.

    Args:
        tokenizer: the model's ``tokenizers.Tokenizer``.
        stop: stop strings (empty strings are ignored).
        skip_special_tokens: drop special tokens (EOS, ...) from the text.
        prompt_ids: tail of the prompt, to prime the decoder so the first output token's leading
            space is decoded in context (SentencePiece-style tokenizers).
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | tuple[str, ...] = (),
                 skip_special_tokens: bool = True, prompt_ids: list[int] | None = None) -> None:
        self._tok = tokenizer
        prime = list(prompt_ids[-8:]) if prompt_ids else None
        self._stream = DecodeStream(ids=prime, skip_special_tokens=skip_special_tokens)
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._stop = [s for s in stop if s]
        self._text = ""        # all text decoded so far (cut at the stop string once found)
        self._emitted = 0      # characters of _text already returned
        self._scanned = 0      # characters of _text already searched for stop strings
        self.matched_stop: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far plus what is held back."""
        return self._text

    def push(self, token_ids: list[int]) -> str:
        """Feed new token ids; return the text delta that is safe to emit now (maybe "").

        After a stop string matched, further tokens are ignored and "" is returned.
        """
        if self.matched_stop is not None:
            return ""
        self._ids.extend(int(t) for t in token_ids)
        for tid in token_ids:
            piece = self._stream.step(self._tok, int(tid))
            if piece:
                self._text += piece
        self._find_stop()
        end = len(self._text) if self.matched_stop is not None else len(self._text) - self._holdback()
        return self._take(end)

    def finish(self, matched_stop: str | None = None) -> str:
        """The request ended: return the remaining text.

        Args:
            matched_stop: the stop string the decode worker reported, if any; when the router did
                not see it itself, the text is cut at its last occurrence in the unemitted part.
        """
        if self.matched_stop is None:
            # bytes DecodeStream still holds (an incomplete UTF-8 sequence at the very end) come
            # out as the full decode does: with U+FFFD replacement characters
            full = self._tok.decode(self._ids, skip_special_tokens=self._skip_special)
            if len(full) > len(self._text) and full.startswith(self._text):
                self._text = full
                self._find_stop()
        if self.matched_stop is None and matched_stop:
            at = self._text.rfind(matched_stop, self._emitted)
            if at >= 0:
                self._text = self._text[:at]
                self.matched_stop = matched_stop
        return self._take(len(self._text))

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        delta = self._text[self._emitted:end]
        self._emitted = end
        return delta

    def _find_stop(self) -> None:
        if not self._stop:
            return
        longest = max(len(s) for s in self._stop)
        start = max(0, self._scanned - longest + 1)
        best: tuple[int, str] | None = None
        for s in self._stop:
            at = self._text.find(s, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        self._scanned = len(self._text)
        if best is not None:
            at = max(best[0], self._emitted)  # never take back text already emitted
            self._text = self._text[:at]
            self.matched_stop = best[1]

    def _holdback(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        keep = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._text)), keep, -1):
                if self._text.endswith(s[:k]):
                    keep = k
                    break
        return keep
