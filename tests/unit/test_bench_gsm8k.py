"""Answer extraction, GSM8K prompt format and the synthetic arithmetic set."""

import pytest

from bench import arith, gsm8k


@pytest.mark.parametrize("text, expected", [
    (" She has 3 + 4 = 7 apples.\n#### 7", 7.0),
    (" 12 * 3 = 36\n#### 36\n\nQuestion: What is 5 + 5?\nAnswer: 10", 36.0),   # stop at the next question
    ("The answer is $1,234.50 in total", 1234.5),
    ("first 3, then 5, so -2", -2.0),
    ("#### no number here but 42 before", 42.0),   # nothing after ####: last number
    ("no digits at all", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert gsm8k.extract_answer(text) == expected


def test_reference_answer_reads_the_hash_line():
    assert gsm8k.reference_answer("2 + 2 = <<2+2=4>>4\n#### 1,000") == 1000.0
    with pytest.raises(ValueError, match="####"):
        gsm8k.reference_answer("no final line 5")


def test_prompt_format():
    rows = [{"question": "Q1?", "answer": "a1\n#### 1"}, {"question": "Q2?", "answer": "a2\n#### 2"}]
    assert gsm8k.few_shot_prefix(rows, 2) == (
        "Question: Q1?\nAnswer: a1\n#### 1\n\nQuestion: Q2?\nAnswer: a2\n#### 2\n\n")
    assert gsm8k.example(rows[0], False) == "Question: Q1?\nAnswer:"
    with pytest.raises(ValueError, match="num_shots"):
        gsm8k.few_shot_prefix(rows, 3)


def test_load_names_the_missing_path(tmp_path):
    with pytest.raises(gsm8k.DataNotFoundError, match="HALFMOON_GSM8K_DIR"):
        gsm8k.load("test", tmp_path)
    with pytest.raises(ValueError, match="split"):
        gsm8k.load("dev", tmp_path)


def test_data_dir_env_override(monkeypatch, tmp_path):
    (tmp_path / "test.jsonl").write_text('{"question": "q", "answer": "#### 3"}\n')
    monkeypatch.setenv("HALFMOON_GSM8K_DIR", str(tmp_path))
    assert gsm8k.data_dir() == tmp_path
    assert gsm8k.load("test") == [{"question": "q", "answer": "#### 3"}]


def test_real_gsm8k_answers_all_parse():
    try:
        rows = gsm8k.load("test")
    except gsm8k.DataNotFoundError as e:
        pytest.skip(f"GSM8K data not present: {e}")
    assert len(rows) == 1319
    assert all(isinstance(gsm8k.reference_answer(r["answer"]), float) for r in rows)


def test_arith_set_is_seeded_and_its_answers_are_right():
    a, b = arith.make_set(200, seed=5), arith.make_set(200, seed=5)
    assert a == b and a != arith.make_set(200, seed=6)
    for row in a:
        expr = row["question"].removeprefix("What is ").removesuffix("?")
        assert gsm8k.reference_answer(row["answer"]) == eval(expr)  # noqa: S307 - our own digits and + - *
        assert eval(expr) >= 0  # noqa: S307
    assert {r["question"].split()[3] for r in a} == {"+", "-", "*"}
    with pytest.raises(ValueError):
        arith.make_set(-1, 0)
