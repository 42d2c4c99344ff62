"""The one incremental detokenizer (engine/detokenizer.py) on the real SmolLM2 tokenizer, as the
engine and decode worker use it (a ``transformers`` tokenizer) and as the router does (its
``tokenizers.Tokenizer`` backend, tokens arriving in chunks): deltas never split a UTF-8 character,
concatenate to the full decode, and never leak any part of a stop string, which is cut exactly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.model_store import resolve_model
from router_svc.tokenizer import RouterTokenizer

TEXT = "Café 世界 🙂🚀 naïve — ok! Ünïcödé"


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def rtok():
    return RouterTokenizer("smollm2-135m-instruct", resolve_model("smollm2-135m-instruct"))


# --------------------------------------------------------------- transformers tokenizer, token by token
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


# --------------------------------------------------------------- the router's tokenizers backend, chunks
TEXTS = ["Grüße aus Köln 🌙 — 日本語のテキスト, emoji 👩‍👩‍👧 and ascii.",
         "Ελληνικά και русский текст; 中文分词测试 🚀🚀",
         "plain text with spaces  and\nnewlines\n\n"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_are_whole_characters_and_add_up(rtok, text, chunk):
    ids = rtok.encode(text)
    assert len(ids) > len(text) // 8  # multi-byte characters span several tokens
    d = IncrementalDetokenizer(rtok.backend)
    deltas = [d.extend(ids[i:i + chunk]) for i in range(0, len(ids), chunk)] + [d.flush()]
    for delta in deltas:
        delta.encode("utf-8")           # a lone surrogate / split character would not encode
        assert "\ufffd" not in delta    # no replacement characters from split bytes
    assert "".join(deltas) == rtok.hf.decode(ids, skip_special_tokens=True) == text


def test_split_emoji_is_held_back(rtok):
    ids = rtok.encode("🌙")
    assert len(ids) > 1
    d = IncrementalDetokenizer(rtok.backend)
    assert [d.extend([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.extend(ids[-1:]) == "🌙"


@pytest.mark.parametrize("stop", ["STOP", "\n\n", "日本", "ü"])
def test_stop_string_removed_and_never_leaked(rtok, stop):
    text = f"before text {stop} after text"
    ids = rtok.encode(text)
    d = IncrementalDetokenizer(rtok.backend, stop=[stop])
    out = ""
    for i in ids:
        out += d.extend([i])
        assert stop not in out
        if d.stop_reason:
            break
    out += d.flush()
    assert d.stop_reason == stop
    assert out == "before text "


def test_partial_stop_prefix_is_released_when_it_does_not_complete(rtok):
    ids = rtok.encode("a STO b STOP")
    d = IncrementalDetokenizer(rtok.backend, stop=["STOP"])
    out = "".join(d.extend([i]) for i in ids) + d.flush()
    assert out == "a STO b "


def test_decoder_reported_stop_is_cut(rtok):
    ids = rtok.encode("hello world")
    d = IncrementalDetokenizer(rtok.backend)   # the router was not told the stop string; D reports it
    out = d.extend(ids)
    out += d.flush(matched_stop=" world")
    assert out in ("hello", "hello world")
    assert d.stop_reason == " world" or out == "hello world"


def test_earliest_of_several_stops_wins(rtok):
    ids = rtok.encode("one two three four")
    d = IncrementalDetokenizer(rtok.backend, stop=["four", "two"])
    out = d.extend(ids) + d.flush()
    assert out == "one " and d.stop_reason == "two"


def test_special_tokens_skipped(rtok):
    eos = rtok.hf.eos_token_id
    ids = rtok.encode("done") + [eos]
    d = IncrementalDetokenizer(rtok.backend)
    assert d.extend(ids) + d.flush() == "done"


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=40),
       chunk=st.integers(1, 4))
def test_any_text_round_trips_in_chunks(rtok, text, chunk):
    ids = rtok.encode(text)
    d = IncrementalDetokenizer(rtok.backend)
    out = "".join(d.extend(ids[i:i + chunk]) for i in range(0, len(ids), chunk)) + d.flush()
    assert out == rtok.hf.decode(ids, skip_special_tokens=True)
