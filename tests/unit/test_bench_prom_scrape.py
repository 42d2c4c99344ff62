"""/metrics scraping: parse the real halfmoon exposition, diff counters, KV summary, over real HTTP."""

import socket

import pytest

from bench import prom_scrape
from telemetry import metrics


def test_parse_keeps_counters_and_histogram_series_and_drops_gauges():
    text = """# HELP halfmoon_transfer_pages_total KV pages written.
# TYPE halfmoon_transfer_pages_total counter
halfmoon_transfer_pages_total 12.0
# HELP halfmoon_transfer_failures_total Failed batches.
# TYPE halfmoon_transfer_failures_total counter
halfmoon_transfer_failures_total{reason="timeout"} 1.0
halfmoon_transfer_failures_total{reason="aborted"} 0.0
# HELP halfmoon_decode_running_requests Running.
# TYPE halfmoon_decode_running_requests gauge
halfmoon_decode_running_requests 3.0
# HELP halfmoon_transfer_batch_seconds Batch.
# TYPE halfmoon_transfer_batch_seconds histogram
halfmoon_transfer_batch_seconds_bucket{le="0.001"} 2.0
halfmoon_transfer_batch_seconds_bucket{le="+Inf"} 3.0
halfmoon_transfer_batch_seconds_count 3.0
halfmoon_transfer_batch_seconds_sum 0.5
"""
    got = prom_scrape.parse(text)
    assert got["halfmoon_transfer_pages_total"] == 12.0
    assert got['halfmoon_transfer_failures_total{reason="timeout"}'] == 1.0
    assert got["halfmoon_transfer_batch_seconds_count"] == 3.0
    assert got['halfmoon_transfer_batch_seconds_bucket{le="+Inf"}'] == 3.0
    assert not any(k.startswith("halfmoon_decode_running") for k in got)


def test_delta_metric_total_and_kv_summary():
    before = {"p": {"halfmoon_transfer_pages_total": 10.0, "halfmoon_transfer_bytes_total": 1000.0},
              "d": {"halfmoon_decode_prefix_hit_tokens_total": 64.0}}
    after = {"p": {"halfmoon_transfer_pages_total": 18.0, "halfmoon_transfer_bytes_total": 1800.0,
                   'halfmoon_transfer_failures_total{reason="timeout"}': 1.0},
             "d": {"halfmoon_decode_prefix_hit_tokens_total": 64.0 + 128.0}}
    d = prom_scrape.delta(before, after)
    assert d["p"] == {"halfmoon_transfer_pages_total": 8.0, "halfmoon_transfer_bytes_total": 800.0,
                      'halfmoon_transfer_failures_total{reason="timeout"}': 1.0}
    assert prom_scrape.metric_total(d, "halfmoon_transfer_failures_total") == 1.0
    kv = prom_scrape.kv_summary(d, requests=4)
    assert kv["kv_pages_transferred"] == 8.0 and kv["kv_pages_per_request"] == 2.0
    assert kv["kv_bytes_per_request"] == 200.0 and kv["decode_prefix_hit_tokens"] == 128.0
    assert prom_scrape.kv_summary(d, requests=0)["kv_pages_per_request"] is None


def test_catalog_names_exist_in_the_metric_catalog():
    names = {m._name for group in metrics.METRICS_BY_GROUP.values() for m in group}
    for full in prom_scrape.KV_METRICS.values():
        assert full.removesuffix("_total") in names, full


def test_scrape_a_live_prefill_metrics_endpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    port = metrics.start_metrics_server(port, "127.0.0.1", role="prefill", worker_id="prefill-test")
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        before = prom_scrape.scrape_all([url])
        metrics.TRANSFER_PAGES.inc(5)
        metrics.TRANSFER_BYTES.inc(5 * 4096)
        after = prom_scrape.scrape_all([url])
        kv = prom_scrape.kv_summary(prom_scrape.delta(before, after), requests=1)
        assert kv["kv_pages_transferred"] == 5.0
        assert kv["kv_bytes_transferred"] == 5 * 4096.0
        assert kv["decode_prefix_hit_tokens"] == 0.0  # decode metrics are not on a prefill process
    finally:
        metrics.stop_metrics_servers()
    with pytest.raises(OSError):
        prom_scrape.scrape(url, timeout_s=2)
