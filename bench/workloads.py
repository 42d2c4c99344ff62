"""Seeded benchmark workloads: random lengths, shared prefix, multi-turn chat, GSM8K few-shot.

Every workload returns a list of :class:`Session`; a single-turn request is a session of one turn.
The same arguments and seed give the same prompts on every machine (``random.Random(seed)``; token
ids drawn from a fixed, sorted list of vocabulary words).

Synthetic prompts are sequences of whole-word tokens (``Ġ`` + letters, BPE tokens that round-trip:
``encode(decode([t])) == [t]``). Word tokens never merge across the space in front of them, so the
text of ``n`` such tokens tokenizes back to exactly those ``n`` ids: a text-only target (an OpenAI
server) and the router (sent token ids) see prompts of the same length.

Workloads (lengths in tokens):

- ``random``: input ~ U[L(1-r), L(1+r)], output ~ U[O(1-r), O(1+r)] (vLLM ``--random-range-ratio``).
- ``shared-prefix``: G groups × a P-token prefix; each request appends a unique S-token suffix
  (SGLang ``generated-shared-prefix``): the case the decode radix cache exists for. Requests are
  shuffled across groups.
- ``multi-turn``: conversations of T turns; each turn adds a U-token user message to the history
  (the actual assistant replies are appended as the run goes, see :mod:`bench.load`).
- ``gsm8k``: N-shot GSM8K prompts (train examples) + a test question (:mod:`bench.gsm8k`).
"""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

from bench import gsm8k
from bench.request import BenchRequest

WORKLOADS = ("random", "shared-prefix", "multi-turn", "gsm8k")
_WORD = re.compile(r"^Ġ[A-Za-z]{2,}$")


@dataclasses.dataclass
class Session:
    """One conversation.

    ``chat`` sessions are multi-turn: turn ``k`` is sent as the history (the user messages of turns
    ``< k`` each followed by the reply the server actually gave) plus ``requests[k].messages[-1]``.
    """

    session_id: int
    requests: list[BenchRequest]
    chat: bool = False


class WordSampler:
    """Draws prompts of an exact token length from the round-tripping word tokens of a tokenizer.

    Args:
        tokenizer_path: a ``tokenizer.json`` file or a model directory holding one.

    Raises:
        FileNotFoundError: no ``tokenizer.json`` there.
        ValueError: the vocabulary has fewer than 1000 usable word tokens.
    """

    def __init__(self, tokenizer_path: str | Path):
        from tokenizers import Tokenizer

        p = Path(tokenizer_path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.exists():
            raise FileNotFoundError(f"tokenizer: {p} does not exist")
        self.tokenizer = Tokenizer.from_file(str(p))
        vocab = self.tokenizer.get_vocab()
        words = sorted(i for tok, i in vocab.items() if _WORD.match(tok))
        self.words = [i for i in words if self.encode(self.decode([i])) == [i]]
        if len(self.words) < 1000:
            raise ValueError(f"tokenizer {p}: only {len(self.words)} word tokens; need >= 1000")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def ids(self, rng: random.Random, n: int) -> list[int]:
        """``n`` word-token ids."""
        return [rng.choice(self.words) for _ in range(n)]

    def text(self, ids: list[int]) -> str:
        """The text of word ids (``" w1 w2 ..."``, leading space kept): ``encode(text(ids)) == ids``."""
        return self.decode(ids)


def _spread(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def _single(session_id: int, words: WordSampler, ids: list[int], max_tokens: int,
            ignore_eos: bool, group: int = -1) -> Session:
    text = words.text(ids)
    req = BenchRequest(prompt=text, prompt_ids=list(ids), max_tokens=max_tokens,
                       ignore_eos=ignore_eos, session_id=session_id, group=group)
    return Session(session_id, [req])


def random_lengths(words: WordSampler, num: int, input_len: int, output_len: int,
                   range_ratio: float, seed: int, ignore_eos: bool = True) -> list[Session]:
    """``num`` single-turn requests of random input/output lengths (tokens)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio: expected [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    out = []
    for i in range(num):
        n_in, n_out = _spread(rng, input_len, range_ratio), _spread(rng, output_len, range_ratio)
        out.append(_single(i, words, words.ids(rng, n_in), n_out, ignore_eos))
    return out


def shared_prefix(words: WordSampler, num: int, groups: int, prefix_len: int, suffix_len: int,
                  output_len: int, seed: int, ignore_eos: bool = True) -> list[Session]:
    """``num`` requests over ``groups`` prefixes of ``prefix_len`` tokens + unique ``suffix_len``.

    Request ``i`` (before shuffling) belongs to group ``i % groups``.
    """
    if groups < 1:
        raise ValueError(f"groups: expected >= 1, got {groups}")
    rng = random.Random(seed)
    prefixes = [words.ids(rng, prefix_len) for _ in range(groups)]
    out = [_single(i, words, prefixes[i % groups] + words.ids(rng, suffix_len), output_len,
                   ignore_eos, group=i % groups) for i in range(num)]
    rng.shuffle(out)
    return out


def multi_turn(words: WordSampler, num_requests: int, turns: int, user_len: int, output_len: int,
               seed: int, ignore_eos: bool = True) -> list[Session]:
    """``ceil(num_requests / turns)`` conversations of ``turns`` turns (``user_len``-token messages)."""
    if turns < 1:
        raise ValueError(f"turns: expected >= 1, got {turns}")
    rng = random.Random(seed)
    out = []
    for s in range(-(-num_requests // turns)):
        reqs = [BenchRequest(messages=[{"role": "user", "content": words.text(words.ids(rng, user_len)).strip()}],
                             max_tokens=output_len, ignore_eos=ignore_eos, session_id=s, turn=t)
                for t in range(turns)]
        out.append(Session(s, reqs, chat=True))
    return out


def gsm8k_prompts(num: int, num_shots: int, output_len: int, seed: int, data_dir: str | None = None,
                  ignore_eos: bool = False) -> list[Session]:
    """``num`` N-shot GSM8K prompts: the first ``num_shots`` train examples + seeded test questions.

    Every prompt shares the few-shot prefix. ``tag`` holds the test-set row index.
    """
    train, test = gsm8k.load("train", data_dir), gsm8k.load("test", data_dir)
    prefix = gsm8k.few_shot_prefix(train, num_shots)
    rng = random.Random(seed)
    idx = [rng.randrange(len(test)) for _ in range(num)]
    return [Session(i, [BenchRequest(prompt=prefix + gsm8k.example(test[j], False), max_tokens=output_len,
                                     ignore_eos=ignore_eos, stop=[] if ignore_eos else list(gsm8k.STOP),
                                     session_id=i, tag=j)])
            for i, j in enumerate(idx)]
