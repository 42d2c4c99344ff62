"""Incremental detokenizer on the real SmolLM2 tokenizer: no split UTF-8 characters, deltas add up
to the full decode, stop strings cut exactly and are not returned."""

from __future__ import annotations

import pytest

from engine.detokenizer import IncrementalDetokenizer

TEXT = "Café 世界 🙂🚀 naïve — ok! Ünïcödé"


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def run(tok, ids, prompt=(), stop=()):
    d = IncrementalDetokenizer(tok, prompt, stop)
    parts = []
    for t in ids:
        parts.append(d.add(t))
        if d.stopped:
            break
    parts.append(d.flush())
    return parts, d


def test_no_split_utf8(tok):
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(TEXT.split())  # multi-byte chars span several byte-level tokens
    parts, _ = run(tok, ids)
    assert all("\ufffd" not in p for p in parts)
    assert "".join(parts) == tok.decode(ids)
    assert sum(1 for p in parts if p == "") > 0  # some tokens were held (incomplete characters)


def test_prompt_context_keeps_leading_space(tok):
    prompt = tok("Hello", add_special_tokens=False)["input_ids"]
    ids = tok("Hello world and more", add_special_tokens=False)["input_ids"][len(prompt):]
    parts, _ = run(tok, ids, prompt=prompt)
    assert "".join(parts) == " world and more"


@pytest.mark.parametrize("stop,want", [
    (["世界"], "Café "),
    (["🚀"], "Café 世界 🙂"),
    (["ok!", "naïve"], "Café 世界 🙂🚀 "),  # earliest match wins
    (["é 世"], "Caf"),
    (["not there"], TEXT),
])
def test_stop_strings(tok, stop, want):
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    parts, d = run(tok, ids, stop=stop)
    assert "".join(parts) == want
    assert d.stopped == (want != TEXT)
    if d.stopped:
        assert d.stop_reason in stop
