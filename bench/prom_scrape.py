"""Scrape Prometheus ``/metrics`` of the prefill/decode workers before and after a run; diff counters.

Counters (``*_total``) and histogram/summary ``_sum``/``_count`` samples are monotonic, so
``after - before`` is what the run did (with no other traffic on the stack). The KV figures come
from the halfmoon metric catalog (:mod:`telemetry.metrics`): every quantity is counted by exactly one
service, so summing a name over all scraped targets never double-counts.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

# Catalog names (telemetry/metrics.py) summarised per run.
KV_METRICS = {
    "kv_pages_transferred": "halfmoon_transfer_pages_total",
    "kv_bytes_transferred": "halfmoon_transfer_bytes_total",
    "transfer_failures": "halfmoon_transfer_failures_total",
    "prefill_prompt_tokens": "halfmoon_prefill_prompt_tokens_total",
    "prefill_cached_tokens": "halfmoon_prefill_cached_tokens_total",
    "decode_prompt_tokens": "halfmoon_decode_prompt_tokens_total",
    "decode_prefix_hit_tokens": "halfmoon_decode_prefix_hit_tokens_total",
    "decode_generated_tokens": "halfmoon_decode_generated_tokens_total",
    "decode_local_prefills": "halfmoon_decode_local_prefills_total",
    "decode_local_prefill_tokens": "halfmoon_decode_local_prefill_tokens_total",
    "decode_resume_recomputed_tokens": "halfmoon_decode_resume_recomputed_tokens_total",
    "decode_evicted_pages": "halfmoon_decode_evicted_pages_total",
}
_MONOTONIC_TYPES = ("counter", "histogram", "summary")


def parse(text: str) -> dict[str, float]:
    """Monotonic samples of a Prometheus text exposition: ``{'name{k="v",...}': value}``.

    Counter samples keep their ``_total`` name; histograms/summaries keep ``_sum``, ``_count`` and
    ``_bucket``. Gauges and ``_created`` samples are dropped.
    """
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type not in _MONOTONIC_TYPES:
            continue
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """GET ``url`` (a ``/metrics`` endpoint) and :func:`parse` it.

    Raises:
        urllib.error.URLError: the endpoint cannot be reached.
    """
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return parse(resp.read().decode("utf-8"))


def scrape_all(urls: Iterable[str]) -> dict[str, dict[str, float]]:
    """``{url: samples}`` for every url."""
    return {u: scrape(u) for u in urls}


def delta(before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
          ) -> dict[str, dict[str, float]]:
    """Per url, the non-zero ``after - before`` of every sample present after (absent before = 0)."""
    out: dict[str, dict[str, float]] = {}
    for url, samples in after.items():
        prev = before.get(url, {})
        d = {k: v - prev.get(k, 0.0) for k, v in samples.items()}
        out[url] = {k: v for k, v in d.items() if v != 0.0}
    return out


def metric_total(deltas: Mapping[str, Mapping[str, float]], name: str) -> float:
    """Sum of one metric (all label sets) over all urls of a :func:`delta` result."""
    total = 0.0
    for samples in deltas.values():
        for key, v in samples.items():
            if key == name or key.startswith(name + "{"):
                total += v
    return total


def kv_summary(deltas: Mapping[str, Mapping[str, float]], requests: int) -> dict[str, float | None]:
    """The :data:`KV_METRICS` totals of a run plus pages/bytes per request (None when 0 requests)."""
    out: dict[str, float | None] = {k: metric_total(deltas, name) for k, name in KV_METRICS.items()}
    out["kv_pages_per_request"] = out["kv_pages_transferred"] / requests if requests else None
    out["kv_bytes_per_request"] = out["kv_bytes_transferred"] / requests if requests else None
    return out
