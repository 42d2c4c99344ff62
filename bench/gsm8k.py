"""GSM8K data: loading, N-shot prompts, answer extraction.

The data (MIT, OpenAI grade-school-math) is never committed: it is read from ``$HALFMOON_GSM8K_DIR``
or ``../shared/data/gsm8k`` relative to the repository root (``train.jsonl``, ``test.jsonl``; one
``{"question": str, "answer": str}`` per line, the final answer after ``#### ``).

Prompt format (SGLang ``benchmark/gsm8k``; lm-eval-harness ``gsm8k`` few-shot uses the same
``Question: ... Answer: ...`` shape)::

    Question: <train q1>
    Answer: <train a1 with its #### line>

    ...

    Question: <test q>
    Answer:
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Stop strings: an answer in the shots never holds a blank line, so one ends the answer (and a
# new "Question:" never belongs to it).
STOP = ["Question:", "\n\n"]
_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class DataNotFoundError(FileNotFoundError):
    """The GSM8K files are not where ``$HALFMOON_GSM8K_DIR`` / ``../shared/data/gsm8k`` point."""


def data_dir() -> Path:
    """``$HALFMOON_GSM8K_DIR``, else ``<repo>/../shared/data/gsm8k``."""
    env = os.environ.get("HALFMOON_GSM8K_DIR")
    return Path(env) if env else (ROOT.parent / "shared" / "data" / "gsm8k")


def load(split: str, path: str | Path | None = None) -> list[dict[str, str]]:
    """Rows ``{"question", "answer"}`` of ``<dir>/<split>.jsonl``.

    Raises:
        DataNotFoundError: the file does not exist.
        ValueError: ``split`` is not ``train`` or ``test``.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split: expected 'train' or 'test', got {split!r}")
    f = Path(path) if path is not None else data_dir()
    f = f / f"{split}.jsonl"
    if not f.exists():
        raise DataNotFoundError(
            f"GSM8K {split} set not found at {f}; set $HALFMOON_GSM8K_DIR or pass --data-dir")
    with f.open() as fh:
        return [json.loads(line) for line in fh if line.strip()]


def example(row: dict[str, str], with_answer: bool) -> str:
    """``Question: q\\nAnswer:`` (+ `` <answer>`` when ``with_answer``)."""
    text = f"Question: {row['question']}\nAnswer:"
    return f"{text} {row['answer']}" if with_answer else text


def few_shot_prefix(train: list[dict[str, str]], num_shots: int) -> str:
    """The first ``num_shots`` train examples with answers, each followed by a blank line."""
    if num_shots < 0 or num_shots > len(train):
        raise ValueError(f"num_shots: expected 0..{len(train)}, got {num_shots}")
    return "".join(example(r, True) + "\n\n" for r in train[:num_shots])


def parse_number(text: str) -> float | None:
    """The number in ``text`` (commas dropped; ``"1,234.5"`` → 1234.5), or None."""
    m = _NUM.search(text)
    if not m:
        return None
    try:
        return float(m.group(0).replace(",", ""))
    except ValueError:
        return None


def extract_answer(text: str) -> float | None:
    """The model's final answer: the first number after the first ``####``, else the last number.

    Only the text before the model starts a new ``Question:`` is looked at.
    """
    text = text.split("Question:")[0]
    if "####" in text:
        got = parse_number(text.split("####", 1)[1])
        if got is not None:
            return got
    nums = _NUM.findall(text)
    for s in reversed(nums):
        got = parse_number(s)
        if got is not None:
            return got
    return None


def reference_answer(answer: str) -> float:
    """The number after ``####`` in a GSM8K ``answer`` field.

    Raises:
        ValueError: there is no ``####`` line with a number.
    """
    if "####" not in answer:
        raise ValueError(f"answer has no '####' line: {answer[-80:]!r}")
    got = parse_number(answer.split("####", 1)[1])
    if got is None:
        raise ValueError(f"answer has no number after '####': {answer[-80:]!r}")
    return got
