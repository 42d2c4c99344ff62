"""Grading eval passes and comparing them: accuracy, per-pass cache/KV figures, output differences.

Used by ``halfmoon eval``. A pass is the list of :class:`~bench.request.RequestRecord` of one sweep
over the questions; ``record.tag`` is the question's index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.gsm8k import extract_answer
from bench.request import RequestRecord


def grade(records: Sequence[RequestRecord], references: Sequence[float]) -> dict[str, Any]:
    """Accuracy of one pass.

    Args:
        records: one record per question (any order; ``tag`` = question index).
        references: reference answers by question index.

    Returns:
        ``{questions, correct, accuracy, invalid, errors, answers}``: ``invalid`` counts outputs with
        no number, ``errors`` failed requests (both count as wrong); ``answers[i]`` is the extracted
        answer of question ``i`` (None when invalid or failed).
    """
    answers: list[float | None] = [None] * len(references)
    correct = invalid = errors = 0
    for r in records:
        if not r.ok:
            errors += 1
            continue
        got = extract_answer(r.text)
        answers[r.tag] = got
        if got is None:
            invalid += 1
        elif abs(got - references[r.tag]) < 1e-6:
            correct += 1
    n = len(references)
    return {"questions": n, "correct": correct, "accuracy": correct / n if n else 0.0,
            "invalid": invalid, "errors": errors, "answers": answers}


def _first_diff(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_passes(first: Sequence[RequestRecord], other: Sequence[RequestRecord]) -> dict[str, Any]:
    """How pass ``other`` differs from pass ``first``, question by question.

    Outputs are compared as token ids when both records carry them (router target), else as text
    (OpenAI target). Greedy decoding through the caches must not change a single token
    (docs/architecture.md, Invariants), so ``differing`` should be 0.

    Returns:
        ``{compared, unit, differing, identical, diffs}`` where ``diffs`` lists
        ``{question, first_diff, len_first, len_other}`` (first differing position, in tokens or
        characters).
    """
    by_q = {r.tag: r for r in first if r.ok}
    diffs = []
    compared = 0
    unit = "tokens"
    for r in other:
        a = by_q.get(r.tag)
        if a is None or not r.ok:
            continue
        compared += 1
        if a.token_ids and r.token_ids:
            sa, sb = a.token_ids, r.token_ids
        else:
            sa, sb, unit = a.text, r.text, "characters"
        pos = _first_diff(sa, sb)
        if pos is not None:
            diffs.append({"question": r.tag, "first_diff": pos, "len_first": len(sa), "len_other": len(sb)})
    diffs.sort(key=lambda d: d["question"])
    return {"compared": compared, "unit": unit, "differing": len(diffs),
            "identical": compared - len(diffs), "diffs": diffs}


def usage_totals(records: Sequence[RequestRecord]) -> dict[str, int | None]:
    """Sums of the usage fields over completed requests (None where no request reported one)."""
    out: dict[str, int | None] = {}
    for field in ("prompt_tokens", "completion_tokens", "cached_tokens", "decode_prefix_tokens",
                  "kv_pages_transferred", "kv_bytes_transferred"):
        vals = [getattr(r, field) for r in records if r.ok and getattr(r, field) >= 0]
        out[field] = sum(vals) if vals else None
    return out
