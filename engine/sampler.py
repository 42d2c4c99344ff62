"""Sampler: logits of a batch -> next tokens (+ logprobs), one :class:`SamplingParams` per row.

Order of processing per row (vLLM/HF convention): ``logit_bias`` added and tokens the row's
grammar forbids masked to -inf (:func:`constrain`) -> penalties (repetition over prompt+output,
frequency/presence over output) -> greedy argmax if ``temperature == 0`` -> divide by temperature
-> top-k -> top-p (smallest set with mass >= top_p, the top token always kept) -> min-p (drop
tokens with ``p < min_p * p_max``) -> renormalise -> ``torch.multinomial`` with the request's
generator. :func:`processed_probs` exposes the final distribution (tests compare it by hand).
Logprobs are those of the raw logits (before bias, mask and processing). A row's grammar is
advanced with its chosen token here.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence

import torch

from engine.grammar import GrammarState, apply_grammars
from engine.sampling_params import SamplingParams


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A per-request generator: seeded when ``seed`` is given, else from Python's RNG."""
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else random.getrandbits(63))
    return g


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> torch.Tensor:
    """logits float32 [V] -> penalised copy."""
    if not params.has_penalties:
        return logits
    logits = logits.clone()
    V = logits.shape[-1]
    dev = logits.device
    out = torch.tensor(list(output_ids), dtype=torch.int64, device=dev)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(list(prompt_ids) + list(output_ids), dtype=torch.int64, device=dev).unique()
        x = logits[seen]
        logits[seen] = torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
    if out.numel() and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(out, minlength=V).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def processed_probs(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int] = (),
                    output_ids: Sequence[int] = ()) -> torch.Tensor:
    """The distribution a non-greedy request samples from: float32 [V], sums to 1.

    For a greedy request returns the one-hot of the argmax.
    """
    x = apply_penalties(logits.float(), params, prompt_ids, output_ids)
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(), x.shape[-1]).float()
    x = x / params.temperature
    V = x.shape[-1]
    if 0 < params.top_k < V:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1)
    if params.top_p < 1.0:
        sp, si = probs.sort(descending=True)
        drop = (sp.cumsum(-1) - sp) >= params.top_p  # mass before this token already reaches top_p
        drop[0] = False
        probs = probs.clone()
        probs[si[drop]] = 0.0
    if params.min_p > 0.0:
        probs = torch.where(probs < params.min_p * probs.max(), torch.zeros_like(probs), probs)
    return probs / probs.sum()


def constrain(logits: torch.Tensor, params: Sequence[SamplingParams],
              grammars: Sequence[GrammarState | None] = ()) -> torch.Tensor:
    """logits float [B, V] -> the logits the sampler picks from: each row's ``logit_bias`` added and
    the tokens its grammar forbids set to -inf, on the logits' device. Returns ``logits`` itself
    (no copy) when no row has either."""
    bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
    g_rows = [i for i, g in enumerate(grammars) if g is not None]
    if not bias_rows and not g_rows:
        return logits
    x = logits.float().clone()
    if bias_rows:
        rows = [i for i in bias_rows for _ in params[i].logit_bias]
        cols = [t for i in bias_rows for t in params[i].logit_bias]
        vals = [b for i in bias_rows for b in params[i].logit_bias.values()]
        dev = x.device
        x.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                     torch.tensor(vals, dtype=x.dtype, device=dev), accumulate=True)
    if g_rows:
        apply_grammars(x, g_rows, [grammars[i] for i in g_rows])
    return x


@dataclasses.dataclass
class SampleOutput:
    token_ids: list[int]  # [B]
    logprobs: list[float | None]  # [B] logprob of the chosen token (raw distribution), or None
    top_logprobs: list[list[tuple[int, float]] | None]  # [B] (token, logprob) best first, or None


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
           prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
           grammars: Sequence[GrammarState | None] = ()) -> SampleOutput:
    """Sample one token per row of ``logits`` (float32 [B, V]).

    ``generators[i]`` may be None only for greedy rows. ``prompt_ids``/``output_ids`` feed penalties.
    ``grammars`` (empty, or one per row, None = unconstrained): each constrained row samples only
    what its grammar allows and its state accepts the chosen token.
    """
    raw = logits
    logits = constrain(logits, params, grammars)
    B = logits.shape[0]
    toks: list[int] = [0] * B
    plain = [p.greedy and not p.has_penalties for p in params]  # once per row: host cost per request-step
    plain_greedy = [i for i, g in enumerate(plain) if g]
    if len(plain_greedy) == B:  # the common decode batch: one argmax, one device->host copy
        toks = logits.argmax(-1).tolist()
    elif plain_greedy:
        am = logits[plain_greedy].argmax(-1).tolist()
        for i, t in zip(plain_greedy, am):
            toks[i] = t
    for i, p in enumerate(params):
        if plain[i]:
            continue
        probs = processed_probs(logits[i], p, prompt_ids[i], output_ids[i])
        if p.greedy:
            toks[i] = int(probs.argmax())
        else:
            toks[i] = int(torch.multinomial(probs, 1, generator=generators[i]))
    for i, g in enumerate(grammars):
        if g is not None:
            g.accept(toks[i])  # allowed by the mask, so accepted (a terminated state ends the request)
    lps: list[float | None] = [None] * B
    tops: list[list[tuple[int, float]] | None] = [None] * B
    want = [i for i, p in enumerate(params) if p.logprobs or p.top_logprobs]
    if want:
        lsm = torch.log_softmax(raw[want].float(), -1)
        for j, i in enumerate(want):
            lps[i] = float(lsm[j, toks[i]])
            k = params[i].top_logprobs
            if k:
                v, ix = torch.topk(lsm[j], k)
                tops[i] = list(zip(ix.tolist(), v.tolist()))
    return SampleOutput(toks, lps, tops)
