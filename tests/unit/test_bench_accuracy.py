"""Eval grading and pass comparison on known records."""

from bench import accuracy
from bench.request import RequestRecord


def r(tag, text, ids=(), ok=True, **kw):
    return RequestRecord(tag=tag, text=text, token_ids=list(ids), ok=ok, **kw)


def test_grade_counts_correct_invalid_and_errors():
    refs = [7.0, 36.0, 5.0, 1.0]
    recs = [r(0, " 3 + 4 = 7\n#### 7"), r(1, " 12 * 3 = 35\n#### 35"), r(2, " I do not know"),
            r(3, "", ok=False, error="UNAVAILABLE")]
    g = accuracy.grade(recs, refs)
    assert (g["correct"], g["invalid"], g["errors"], g["questions"]) == (1, 1, 1, 4)
    assert g["accuracy"] == 0.25
    assert g["answers"] == [7.0, 35.0, None, None]


def test_compare_passes_by_token_ids_then_by_text():
    first = [r(0, "a", [1, 2, 3]), r(1, "b", [4, 5]), r(2, "c", [6])]
    second = [r(1, "b", [4, 5, 9]), r(0, "a", [1, 2, 3]), r(2, "c", [7])]
    c = accuracy.compare_passes(first, second)
    assert c["unit"] == "tokens" and c["compared"] == 3 and c["differing"] == 2 and c["identical"] == 1
    assert c["diffs"] == [{"question": 1, "first_diff": 2, "len_first": 2, "len_other": 3},
                          {"question": 2, "first_diff": 0, "len_first": 1, "len_other": 1}]
    t = accuracy.compare_passes([r(0, "hello world")], [r(0, "hello there")])
    assert t["unit"] == "characters" and t["diffs"][0]["first_diff"] == 6


def test_usage_totals_skip_unreported_fields():
    recs = [r(0, "x", prompt_tokens=10, kv_pages_transferred=2), r(1, "y", prompt_tokens=5, kv_pages_transferred=0),
            r(2, "z", ok=False, prompt_tokens=99)]
    u = accuracy.usage_totals(recs)
    assert u["prompt_tokens"] == 15 and u["kv_pages_transferred"] == 2 and u["cached_tokens"] is None
