"""A seeded synthetic arithmetic set: a smoke floor for accuracy.

Small models score ~0% on GSM8K, so a broken pipeline and a working one look alike there. These
problems (adding or subtracting a single digit to/from a number up to 30, single-digit products) are
easy enough that the default model (SmolLM2-135M-Instruct, fp32, greedy, 4-shot) scores well above
zero: 52% on 60 questions with ``transformers`` directly, 58% on 50 through the 1P1D stack
(bench/results/eval_arith_1p1d_50q.json; about 36% on a similar generated set of 4-shot problems). A
result near zero means the serving path is broken. Rows have the GSM8K shape (``question``, ``answer`` ending in ``#### n``) so
the GSM8K prompt builder and answer extraction apply unchanged.
"""

from __future__ import annotations

import random


def make_problem(rng: random.Random) -> dict[str, str]:
    """One ``{"question", "answer"}`` row drawn from ``rng``."""
    op = rng.choice(["+", "-", "*"])
    if op == "*":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        value = a * b
    elif op == "+":
        a, b = rng.randint(2, 30), rng.randint(2, 9)
        value = a + b
    else:
        a, b = rng.randint(10, 30), rng.randint(2, 9)
        value = a - b
    return {"question": f"What is {a} {op} {b}?", "answer": f"{a} {op} {b} = {value}\n#### {value}"}


def make_set(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` problems, the same for the same ``seed`` on every machine.

    Raises:
        ValueError: ``n`` < 0.
    """
    if n < 0:
        raise ValueError(f"n: expected >= 0, got {n}")
    rng = random.Random(seed)
    return [make_problem(rng) for _ in range(n)]
