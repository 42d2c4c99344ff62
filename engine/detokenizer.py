"""Incremental detokenizer: token ids in, text deltas out, never a split UTF-8 character, with
stop strings cut out. The one detokenizer of the project: the co-located engine and the decode
worker (stop strings) feed it a ``transformers`` tokenizer, the router (the text clients see) a
``tokenizers.Tokenizer``; both only need ``decode(ids, skip_special_tokens=...)``.

Text of new tokens is found by decoding a short window ``ids[prefix_offset:]`` and subtracting the
decode of ``ids[prefix_offset:read_offset]`` (the method of TGI / vLLM ``detokenize_incrementally``):
decoding a window that starts a few tokens back keeps word-initial spaces right, and a window whose
text ends in U+FFFD (an incomplete UTF-8 sequence) is held until the next token completes it.

Stop strings: the longest end of the text that is still the start of some stop string is held back
(so no part of a stop string is ever emitted); when a stop string appears, the text is cut before it
(OpenAI semantics: the stop string is not returned) and ``stopped`` turns True. Tokens are taken one
at a time, so the stop string that completes first wins, as on the decode worker that generated
them. :meth:`flush` releases held text when the request ends for another reason.
"""

from __future__ import annotations

from typing import Iterable, Sequence

CONTEXT_TOKENS = 5  # prompt tokens to seed the window with (so the first output token's space is kept)


class IncrementalDetokenizer:
    """One request's detokenizer.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)`` (``transformers`` or
            ``tokenizers``).
        prompt_ids: the prompt (its last ``CONTEXT_TOKENS`` ids seed the window).
        stop: stop strings (empty strings are ignored).
        skip_special_tokens: drop special tokens (EOS, ...) from the text.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = [s for s in stop if s]
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.text = ""  # output text so far (stop string and what follows removed once stopped)
        self.emitted = 0  # chars of self.text already returned
        self.stopped = False
        self.stop_reason: str | None = None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the text now safe to emit ("" while held back, and
        after a stop string matched)."""
        if self.stopped:
            return ""
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._append(full[len(prefix):])
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._take(final=False)

    def extend(self, token_ids: Iterable[int]) -> str:
        """Feed several tokens (a streamed chunk); the concatenation of their :meth:`add` results."""
        return "".join(self.add(t) for t in token_ids)

    def _append(self, delta: str) -> None:
        start = max(0, len(self.text) - self.longest_stop + 1)  # a new match ends inside ``delta``
        self.text += delta
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self._cut(best[0], best[1])

    def _cut(self, at: int, stop: str) -> None:
        self.text = self.text[: max(at, self.emitted)]  # text already emitted is never taken back
        self.stopped = True
        self.stop_reason = stop

    def _holdback(self) -> int:
        """Length of the longest end of the text that is a proper prefix of a stop string."""
        keep = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), keep, -1):
                if self.text.endswith(s[:k]):
                    keep = k
                    break
        return keep

    def _take(self, final: bool) -> str:
        end = len(self.text) if (final or self.stopped) else len(self.text) - self._holdback()
        end = max(end, self.emitted)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out

    def flush(self, matched_stop: str | None = None) -> str:
        """The request ended (length, EOS, stop token, abort): return everything still held,
        including an incomplete trailing character's decode (as U+FFFD).

        Args:
            matched_stop: a stop string another process reported (the router passes the one the
                decode worker matched); when this detokenizer did not match it itself, the text is
                cut at its last occurrence in the part not yet emitted.
        """
        if not self.stopped and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix):
                self._append(full[len(prefix):])
            self.prefix_offset = self.read_offset = len(self.ids)
        if not self.stopped and matched_stop:
            at = self.text.rfind(matched_stop, self.emitted)
            if at >= 0:
                self._cut(at, matched_stop)
        return self._take(final=True)
