"""Streaming detokenization: deltas never split a UTF-8 character, concatenate to the full decode,
and never leak any part of a stop string."""

import pytest
from hypothesis import given, settings, strategies as st

from engine.model_store import resolve_model
from router_svc.detokenizer import StreamDetokenizer
from router_svc.tokenizer import RouterTokenizer


@pytest.fixture(scope="module")
def tok():
    return RouterTokenizer("smollm2-135m-instruct", resolve_model("smollm2-135m-instruct"))


TEXTS = ["Grüße aus Köln 🌙 — 日本語のテキスト, emoji 👩‍👩‍👧 and ascii.",
         "Ελληνικά και русский текст; 中文分词测试 🚀🚀",
         "plain text with spaces  and\nnewlines\n\n"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_are_whole_characters_and_add_up(tok, text, chunk):
    ids = tok.encode(text)
    assert len(ids) > len(text) // 8  # multi-byte characters span several tokens
    d = StreamDetokenizer(tok.backend)
    deltas = [d.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)] + [d.finish()]
    for delta in deltas:
        delta.encode("utf-8")           # a lone surrogate / split character would not encode
        assert "\ufffd" not in delta    # no replacement characters from split bytes
    assert "".join(deltas) == tok.hf.decode(ids, skip_special_tokens=True) == text


def test_split_emoji_is_held_back(tok):
    ids = tok.encode("🌙")
    assert len(ids) > 1
    d = StreamDetokenizer(tok.backend)
    assert [d.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.push(ids[-1:]) == "🌙"


@pytest.mark.parametrize("stop", ["STOP", "\n\n", "日本", "ü"])
def test_stop_string_removed_and_never_leaked(tok, stop):
    text = f"before text {stop} after text"
    ids = tok.encode(text)
    d = StreamDetokenizer(tok.backend, stop=[stop])
    out = ""
    for i in ids:
        out += d.push([i])
        assert stop not in out
        if d.matched_stop:
            break
    out += d.finish()
    assert d.matched_stop == stop
    assert out == "before text "


def test_partial_stop_prefix_is_released_when_it_does_not_complete(tok):
    ids = tok.encode("a STO b STOP")
    d = StreamDetokenizer(tok.backend, stop=["STOP"])
    out = "".join(d.push([i]) for i in ids) + d.finish()
    assert out == "a STO b "


def test_decoder_reported_stop_is_cut(tok):
    ids = tok.encode("hello world")
    d = StreamDetokenizer(tok.backend)   # the router was not told the stop string; D reports it
    out = d.push(ids)
    out += d.finish(matched_stop=" world")
    assert out in ("hello", "hello world")
    assert d.matched_stop == " world" or out == "hello world"


def test_earliest_of_several_stops_wins(tok):
    ids = tok.encode("one two three four")
    d = StreamDetokenizer(tok.backend, stop=["four", "two"])
    out = d.push(ids) + d.finish()
    assert out == "one " and d.matched_stop == "two"


def test_special_tokens_skipped(tok):
    eos = tok.hf.eos_token_id
    ids = tok.encode("done") + [eos]
    d = StreamDetokenizer(tok.backend)
    assert d.push(ids) + d.finish() == "done"


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=40),
       chunk=st.integers(1, 4))
def test_any_text_round_trips_in_chunks(tok, text, chunk):
    ids = tok.encode(text)
    d = StreamDetokenizer(tok.backend)
    out = "".join(d.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)) + d.finish()
    assert out == tok.hf.decode(ids, skip_special_tokens=True)
