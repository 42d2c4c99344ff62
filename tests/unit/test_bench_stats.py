"""Serving-latency math on hand-computed inputs: percentiles, ITL/TPOT definitions, goodput, timeline."""

import math

import numpy as np
import pytest

from bench import stats
from bench.request import RequestRecord


def rec(start, chunks, tokens=None, end=None, ok=True, completion=-1, **kw):
    tokens = tokens if tokens is not None else [1] * len(chunks)
    return RequestRecord(start=start, chunk_times=list(chunks), chunk_tokens=list(tokens),
                         end=end if end is not None else (chunks[-1] if chunks else start), ok=ok,
                         completion_tokens=completion, **kw)


def test_itl_splits_multi_token_chunks_evenly_and_skips_the_first_chunk():
    # first chunk at 1.0 (2 tokens: TTFT only), then 1 token 0.5 s later, then 4 tokens 2.0 s later.
    gaps = stats.itl_gaps([1.0, 1.5, 3.5], [2, 1, 4])
    assert gaps == pytest.approx([0.5, 0.5, 0.5, 0.5, 0.5])
    assert len(gaps) == 1 + 4


def test_itl_rejects_mismatched_or_empty_chunks():
    with pytest.raises(ValueError, match="chunk_tokens"):
        stats.itl_gaps([1.0, 2.0], [1])
    with pytest.raises(ValueError, match=">= 1 token"):
        stats.itl_gaps([1.0, 2.0], [1, 0])


def test_tpot_is_decode_time_over_tokens_after_the_first():
    # 5 tokens, first at 0.2 s, last at 1.0 s: (1.0 - 0.2) / 4 = 0.2 s
    assert stats.tpot([0.2, 0.4, 0.6, 0.8, 1.0], 5) == pytest.approx(0.2)
    # tokens counted from usage (e.g. 9 tokens in 2 OpenAI chunks): (1.0 - 0.2) / 8
    assert stats.tpot([0.2, 1.0], 9) == pytest.approx(0.1)
    assert stats.tpot([0.2], 1) is None
    assert stats.tpot([], 0) is None


def test_distribution_percentiles_match_linear_interpolation():
    d = stats.distribution([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], scale=1000.0)
    assert d["n"] == 10
    assert d["mean"] == pytest.approx(5500.0)
    assert d["p50"] == pytest.approx(5500.0)       # between 5 and 6
    assert d["p90"] == pytest.approx(9100.0)       # 9 + 0.1 * (10 - 9)
    assert d["p99"] == pytest.approx(9910.0)
    assert d["min"] == 1000.0 and d["max"] == 10000.0
    assert d["p90"] == pytest.approx(np.percentile(np.arange(1, 11) * 1000.0, 90))


def test_distribution_of_nothing_is_all_none():
    d = stats.distribution([])
    assert d["n"] == 0 and d["p50"] is None and d["mean"] is None


def test_slo_and_goodput_count_only_requests_meeting_every_objective():
    recs = [
        rec(0.0, [0.1, 0.2, 0.3]),          # ttft 100 ms, tpot 100 ms, e2e 300 ms: good
        rec(0.0, [0.5, 0.6]),               # ttft 500 ms: misses TTFT 200
        rec(0.0, [0.1, 0.5, 0.9]),          # tpot 400 ms: misses TPOT 200
        rec(0.0, [0.1]),                    # one token: no TPOT, counts as meeting it
        rec(0.0, [], ok=False),             # failed: never good
    ]
    slo = stats.SLO(ttft_ms=200, tpot_ms=200)
    assert [slo.met(r) for r in recs] == [True, False, False, True, False]
    g = stats.goodput(recs, duration_s=2.0, slo=slo)
    assert g["good"] == 2
    assert g["requests_per_s"] == pytest.approx(1.0)
    assert g["fraction"] == pytest.approx(2 / 5)
    assert stats.SLO(e2e_ms=250).met(recs[0]) is False
    assert stats.goodput(recs, 2.0, stats.SLO())["good"] == 4  # no SLO: every completed request


def test_summarize_counts_tokens_throughput_and_kv_from_usage():
    a = rec(0.0, [0.2, 0.4, 0.6], end=0.7, prompt_tokens=100, cached_tokens=0, kv_pages_transferred=7,
            kv_bytes_transferred=7000)
    b = rec(0.5, [0.6, 1.0], tokens=[1, 3], end=1.0, prompt_tokens=50, cached_tokens=32,
            kv_pages_transferred=1, kv_bytes_transferred=1000)
    bad = rec(0.0, [], ok=False, error="UNAVAILABLE: down")
    s = stats.summarize([a, b, bad], duration_s=1.0)
    assert (s["requests"], s["completed"], s["errors"]) == (3, 2, 1)
    assert s["error_examples"] == ["UNAVAILABLE: down"]
    assert s["tokens"] == {"input": 150, "output": 3 + 4, "cached": 32, "decode_prefix": None}
    assert s["output_tokens_per_s"] == pytest.approx(7.0)
    assert s["input_tokens_per_s"] == pytest.approx(150.0)
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["ttft_ms"]["n"] == 2 and s["ttft_ms"]["p50"] == pytest.approx(150.0)  # 200 and 100 ms
    assert s["itl_ms"]["n"] == 2 + 3                                                # 0.2,0.2 | 3 x 0.4/3
    assert s["itl_ms"]["max"] == pytest.approx(200.0)
    assert s["tpot_ms"]["n"] == 2
    assert sorted([s["tpot_ms"]["min"], s["tpot_ms"]["max"]]) == pytest.approx([400 / 3, 200.0])
    assert s["kv_usage"] == {"pages_transferred": 8, "bytes_transferred": 8000,
                             "pages_per_request": 4.0, "bytes_per_request": 4000.0}


def test_timeline_bins_tokens_at_their_arrival():
    a = rec(0.0, [0.5, 1.2, 1.7], tokens=[1, 2, 1], end=1.8)
    b = rec(0.0, [2.5], tokens=[4], end=2.6)
    tl = stats.timeline([a, b], t0=0.0, bin_s=1.0)
    assert [x["output_tokens_per_s"] for x in tl] == [1.0, 3.0, 4.0]
    assert [x["requests_per_s"] for x in tl] == [0.0, 1.0, 1.0]
    assert math.isclose(sum(x["output_tokens_per_s"] for x in tl), 8.0)


def test_record_output_tokens_prefers_usage():
    assert rec(0.0, [0.1, 0.2], completion=5).output_tokens == 5
    assert rec(0.0, [0.1, 0.2], tokens=[2, 3]).output_tokens == 5
