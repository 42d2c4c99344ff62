"""Serving-latency math: TTFT, ITL, TPOT, E2E percentiles, throughput and goodput.

Definitions (the same as vLLM's and SGLang's ``bench_serving``; units are seconds unless noted):

- TTFT: send → first chunk that carries output.
- ITL (inter-token latency): gaps between successive output tokens. A chunk carrying ``k`` tokens that
  arrived ``dt`` after the previous chunk contributes ``k`` gaps of ``dt / k`` (SGLang
  ``bench_serving``); tokens in the first chunk contribute none (they are covered by TTFT).
- TPOT (time per output token, per request): ``(t_last_chunk - t_first_chunk) / (output_tokens - 1)``;
  undefined for requests with fewer than 2 output tokens (left out of the TPOT statistics and
  counted as meeting a TPOT SLO).
- E2E: send → end of the stream.
- Goodput (DistServe, vLLM ``--goodput``): completed requests per second of benchmark duration that
  met every given SLO (TTFT, TPOT, E2E, each optional).
- Percentiles: linear interpolation between closest ranks (``numpy.percentile`` default).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from bench.request import RequestRecord

PERCENTILES = (50, 90, 99)


def itl_gaps(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Per-token inter-token gaps (seconds) of one request.

    Args:
        chunk_times: arrival time of each chunk that carried output (seconds, increasing).
        chunk_tokens: output tokens in each chunk (same length, each >= 1).

    Returns:
        ``sum(chunk_tokens[1:])`` gaps.

    Raises:
        ValueError: the lengths differ or a chunk carries fewer than 1 token.
    """
    if len(chunk_times) != len(chunk_tokens):
        raise ValueError(f"chunk_times has {len(chunk_times)} entries, chunk_tokens {len(chunk_tokens)}")
    gaps: list[float] = []
    for i in range(1, len(chunk_times)):
        k = chunk_tokens[i]
        if k < 1:
            raise ValueError(f"chunk_tokens[{i}] = {k}; every output chunk carries >= 1 token")
        dt = chunk_times[i] - chunk_times[i - 1]
        gaps.extend([dt / k] * k)
    return gaps


def tpot(chunk_times: Sequence[float], output_tokens: int) -> float | None:
    """Time per output token after the first (seconds), or None when ``output_tokens < 2``."""
    if output_tokens < 2 or len(chunk_times) < 1:
        return None
    return (chunk_times[-1] - chunk_times[0]) / (output_tokens - 1)


def distribution(values: Iterable[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """``{n, mean, std, min, p50, p90, p99, max}`` of ``values * scale`` (None entries when empty)."""
    arr = np.asarray(list(values), dtype=np.float64) * scale
    out: dict[str, float | int | None] = {"n": int(arr.size)}
    if arr.size == 0:
        out.update(mean=None, std=None, min=None, max=None, **{f"p{p}": None for p in PERCENTILES})
        return out
    out.update(mean=float(arr.mean()), std=float(arr.std()), min=float(arr.min()))
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p))
    out["max"] = float(arr.max())
    return out


@dataclasses.dataclass(frozen=True)
class SLO:
    """Service-level objective; ``None`` fields are not checked. Units: milliseconds."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met(self, rec: RequestRecord) -> bool:
        """Whether a completed request meets every set objective (a failed request never does)."""
        if not rec.ok:
            return False
        ttft = rec.ttft
        if self.ttft_ms is not None and (ttft is None or ttft * 1e3 > self.ttft_ms):
            return False
        t = tpot(rec.chunk_times, rec.output_tokens)
        if self.tpot_ms is not None and t is not None and t * 1e3 > self.tpot_ms:
            return False
        if self.e2e_ms is not None and rec.e2e * 1e3 > self.e2e_ms:
            return False
        return True


def goodput(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> dict[str, Any]:
    """``{slo, good, requests_per_s, fraction}``: requests meeting ``slo`` per second of ``duration_s``.

    ``fraction`` is good / all requests (failed ones included). With no SLO set every completed
    request counts as good.
    """
    good = sum(1 for r in records if slo.met(r))
    return {
        "slo": dataclasses.asdict(slo),
        "good": good,
        "requests_per_s": good / duration_s if duration_s > 0 else 0.0,
        "fraction": good / len(records) if records else 0.0,
    }


def timeline(records: Sequence[RequestRecord], t0: float, bin_s: float = 1.0) -> list[dict[str, float]]:
    """Output tokens/s and completed requests/s per ``bin_s`` bin since ``t0`` (throughput over time).

    Tokens are placed at the arrival time of the chunk that carried them.
    """
    events: list[tuple[float, int]] = []
    ends: list[float] = []
    for r in records:
        if r.ok:
            events.extend(zip(r.chunk_times, r.chunk_tokens))
            ends.append(r.end)
    if not events and not ends:
        return []
    last = max([t for t, _ in events] + ends) - t0
    nbins = max(1, math.ceil(last / bin_s + 1e-9))
    tok = np.zeros(nbins)
    done = np.zeros(nbins)
    for t, k in events:
        tok[min(nbins - 1, int((t - t0) / bin_s))] += k
    for t in ends:
        done[min(nbins - 1, int((t - t0) / bin_s))] += 1
    return [{"t": i * bin_s, "output_tokens_per_s": float(tok[i] / bin_s),
             "requests_per_s": float(done[i] / bin_s)} for i in range(nbins)]


def _known_sum(values: Iterable[int]) -> int | None:
    vals = list(values)
    known = [v for v in vals if v >= 0]
    return sum(known) if known else None


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO = SLO()) -> dict[str, Any]:
    """The headline numbers of a run.

    Args:
        records: every measured request (failed ones included; they count as errors).
        duration_s: wall time from the first send to the last stream end (seconds).
        slo: objectives for goodput.

    Returns:
        dict with counts, throughputs (per second), latency distributions in milliseconds
        (``ttft_ms``, ``itl_ms``, ``tpot_ms``, ``e2e_ms``), ``goodput``, token and KV totals
        (None where no request reported the usage field) and per-request KV means.
    """
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    in_tok = _known_sum(r.prompt_tokens for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    itl: list[float] = []
    tpots: list[float] = []
    for r in ok:
        itl.extend(itl_gaps(r.chunk_times, r.chunk_tokens))
        t = tpot(r.chunk_times, r.output_tokens)
        if t is not None:
            tpots.append(t)
    pages = _known_sum(r.kv_pages_transferred for r in ok)
    kv_bytes = _known_sum(r.kv_bytes_transferred for r in ok)
    per = (lambda v: v / len(ok) if (v is not None and ok) else None)
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(failed),
        "error_examples": sorted({r.error for r in failed})[:5],
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "input_tokens_per_s": (in_tok / duration_s) if (in_tok is not None and duration_s > 0) else None,
        "output_tokens_per_s": out_tok / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": distribution((r.ttft for r in ok if r.ttft is not None), 1e3),
        "itl_ms": distribution(itl, 1e3),
        "tpot_ms": distribution(tpots, 1e3),
        "e2e_ms": distribution((r.e2e for r in ok), 1e3),
        "goodput": goodput(records, duration_s, slo),
        "tokens": {
            "input": in_tok,
            "output": out_tok,
            "cached": _known_sum(r.cached_tokens for r in ok),
            "decode_prefix": _known_sum(r.decode_prefix_tokens for r in ok),
        },
        "kv_usage": {
            "pages_transferred": pages,
            "bytes_transferred": kv_bytes,
            "pages_per_request": per(pages),
            "bytes_per_request": per(kv_bytes),
        },
    }
