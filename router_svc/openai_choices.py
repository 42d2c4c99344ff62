"""The choices of an OpenAI answer (``choices[i]``, one per sample: router_svc/fanout.py): each
has its own logprob offsets, tool-call streamer, text and finish reason; ``usage`` counts the prompt
once and every returned choice's completion tokens."""

from __future__ import annotations

from protos import router_pb2
from router_svc.tokenizer import RouterTokenizer
from router_svc.tool_calls import ToolMode, ToolStreamer


class Logprobs:
    """Accumulates OpenAI logprob entries of one choice from streamed TokenLogprob messages."""

    def __init__(self, tok: RouterTokenizer, chat: bool) -> None:
        self.tok = tok
        self.chat = chat
        self.offset = 0

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.tok.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def convert(self, lps) -> dict | None:
        if not lps:
            return None
        if self.chat:
            return {"content": [dict(self._entry(lp.token_id, lp.logprob),
                                     top_logprobs=[self._entry(t.token_id, t.logprob) for t in lp.top])
                                for lp in lps]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            text = self.tok.token_text(lp.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({self.tok.token_text(t.token_id): t.logprob for t in lp.top} or None)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    @staticmethod
    def merge(acc: dict | None, part: dict | None) -> dict | None:
        if part is None:
            return acc
        if acc is None:
            return part
        for key, value in part.items():
            acc[key].extend(value)
        return acc


def tool_result(tools: ToolMode | ToolStreamer, finish_reason: str, text: str = ""):
    """(content, calls) of a finished output (a streamer: the content not streamed yet); a forced
    call cut by max_tokens stays content."""
    try:
        return tools.finish() if isinstance(tools, ToolStreamer) else tools.parse(text)
    except ValueError:
        if finish_reason == "length":
            return (tools.text[tools.sent:] if isinstance(tools, ToolStreamer) else text), []
        raise


class Choice:
    """One choice, built from its sample's responses.

    Args:
        index: ``choices[i].index``.
        chat: chat shape (``message`` / ``delta``) rather than completions (``text``).
        tools: the request's tool mode (chat), None when no tools are in play.
        echo: text put before the choice's own (completions ``echo``: the prompt).
    """

    def __init__(self, index: int, tok: RouterTokenizer, chat: bool, tools: ToolMode | None = None,
                 echo: str = "") -> None:
        self.index, self.chat, self.tools = index, chat, tools
        self.lp = Logprobs(tok, chat)
        self.streamer = ToolStreamer(tools) if tools is not None else None
        self.pending_echo = echo
        self.text: list[str] = [echo]
        self.logprobs: dict | None = None
        self.last: router_pb2.GenerateResponse | None = None

    def add(self, resp: router_pb2.GenerateResponse) -> None:
        """Accumulate one response (non-streamed answers)."""
        self.text.append(resp.text)
        self.logprobs = Logprobs.merge(self.logprobs, self.lp.convert(resp.logprobs))
        self.last = resp

    def body(self) -> dict:
        """The finished choice of a non-streamed answer."""
        text, last = "".join(self.text), self.last
        choice = {"index": self.index, "logprobs": self.logprobs, "finish_reason": last.finish_reason}
        if self.chat and self.tools is not None:
            content, calls = tool_result(self.tools, last.finish_reason, text)
            choice["message"] = {"role": "assistant", "content": content}
            if calls:
                choice["message"]["tool_calls"] = [c.openai() for c in calls]
                choice["finish_reason"] = "tool_calls"
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return choice

    def role_delta(self) -> dict:
        """A streamed chat choice's first delta."""
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, resp: router_pb2.GenerateResponse) -> dict | None:
        """The streamed choice for one response; None when it has nothing to send. Tools: content
        streams while it cannot be a call; calls go in the choice's last chunk."""
        self.last = resp if resp.finish_reason else self.last
        if self.streamer is not None:
            text = self.streamer.feed(resp.text)
            calls = []
            if resp.finish_reason:
                rest, calls = tool_result(self.streamer, resp.finish_reason)
                text += rest
            if not text and not resp.finish_reason and not resp.logprobs:
                return None
            delta = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = [c.openai(index=i) for i, c in enumerate(calls)]
            finish = ("tool_calls" if calls else resp.finish_reason) or None
            return {"index": self.index, "delta": delta, "logprobs": self.lp.convert(resp.logprobs),
                    "finish_reason": finish}
        text = self.pending_echo + resp.text
        if not text and not resp.finish_reason and not resp.logprobs:
            return None
        self.pending_echo = ""
        choice = {"index": self.index, "logprobs": self.lp.convert(resp.logprobs),
                  "finish_reason": resp.finish_reason or None}
        if self.chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        return choice


def usage(choices: list[Choice]) -> dict:
    """OpenAI ``usage`` of finished choices: the prompt once (the samples are one prefill, so they
    report the same cached tokens; the fewest is taken), completion tokens summed over the choices."""
    us = [c.last.usage for c in choices if c.last is not None]
    prompt = max((u.prompt_tokens for u in us), default=0)
    completion = sum(u.completion_tokens for u in us)
    cached = min((u.cached_tokens for u in us), default=0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


__all__ = ["Choice", "Logprobs", "tool_result", "usage"]
