"""Writes deploy/grafana/halfmoon-dashboard.json (and the Helm chart's copy) from the panel list below.

Run ``python deploy/grafana/build_dashboard.py`` after editing; tests fail when the committed JSON
and this script disagree. Every expression is plain PromQL without Grafana variables (the
datasource is a dashboard variable), so tests can send each one to a live Prometheus unchanged.
Recording rules (``halfmoon:*``) come from deploy/prometheus/rules.yaml; raw metrics from
telemetry/metrics.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "halfmoon-dashboard.json"
CHART_COPY = HERE.parent / "k8s" / "halfmoon" / "files" / "halfmoon-dashboard.json"
DS = {"type": "prometheus", "uid": "${datasource}"}



def quantiles(histogram: str) -> list[tuple[str, str]]:
    """(expr, legend) of a histogram's p50 and p99 over 1m, all series together."""
    return [(f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket[1m])))", legend)
            for q, legend in (("0.5", "p50"), ("0.99", "p99"))]


def recorded_quantiles(name: str) -> list[tuple[str, str]]:
    """(expr, legend) of the recording rules halfmoon:<name>:p50_1m and :p99_1m."""
    return [(f"halfmoon:{name}:{legend}_1m", legend) for legend in ("p50", "p99")]


# (row title, [(panel title, kind, unit, description, [(expr, legend)])]) ; kind: timeseries | stat
ROWS = [
    ("Overview", [
        ("Requests per second by status", "timeseries", "reqps",
         "Finished client requests per second at the router, by final status.",
         [("halfmoon:router_requests:rate1m", "{{status}}")]),
        ("Time to first token", "timeseries", "s", "Router TTFT quantiles over 1m.",
         recorded_quantiles("router_ttft_seconds")),
        ("Inter-token latency", "timeseries", "s", "Router ITL quantiles over 1m.",
         recorded_quantiles("router_itl_seconds")),
        ("End-to-end latency", "timeseries", "s", "Request arrival to last token, quantiles over 1m.",
         recorded_quantiles("router_e2e_seconds")),
        ("Error ratio", "stat", "percentunit",
         "Share of router requests ending in error or timeout over 5m.",
         [("halfmoon:router_error_ratio:rate5m", "errors")]),
        ("Requests in flight", "stat", "short", "Requests accepted by the routers and not finished.",
         [("sum(halfmoon_router_requests_in_flight)", "in flight")]),
        ("Tokens per second", "timeseries", "short", "Prompt and completion tokens per second (router).",
         [("sum(rate(halfmoon_router_prompt_tokens_total[1m]))", "prompt"),
          ("sum(rate(halfmoon_router_completion_tokens_total[1m]))", "completion")]),
        ("Retries by failed leg", "timeseries", "short",
         "Prefill/decode pair re-picks per second after a leg failed before the first token.",
         [("sum by (leg) (rate(halfmoon_router_retries_total[1m]))", "{{leg}}")]),
        ("Stream migrations by reason", "timeseries", "short",
         "Streams moved to another pair per second after their decode worker failed or drained mid-stream.",
         [("sum by (reason) (rate(halfmoon_router_migrations_total[1m]))", "{{reason}}")]),
        ("Conditional disaggregation", "timeseries", "short",
         "Per second: attempts the router sent to a decode worker alone (by reason), the local prefills "
         "decode workers ran, and the prompt tokens they computed.",
         [("sum by (reason) (rate(halfmoon_router_local_prefills_total[1m]))", "routed {{reason}}"),
          ("sum(rate(halfmoon_decode_local_prefills_total[1m]))", "decode local prefills"),
          ("sum(rate(halfmoon_decode_local_prefill_tokens_total[1m]))", "tokens computed on decode")]),
    ]),
    ("Front door", [
        ("Requests per second by tenant", "timeseries", "reqps",
         "Finished client requests per second by API key tenant (key file names, default, anonymous).",
         [("sum by (tenant) (rate(halfmoon_router_requests_total[1m]))", "{{tenant}}")]),
        ("Refused requests", "timeseries", "reqps",
         "Requests refused by the rate limit or the admission queue (HTTP 429), and calls refused "
         "for a missing or unknown API key (401 / UNAUTHENTICATED), per second.",
         [('sum by (status) (rate(halfmoon_router_requests_total{status=~"rate_limited|queue_full"}[1m]))',
           "{{status}}"),
          ("sum by (api, reason) (rate(halfmoon_router_auth_failures_total[1m]))", "auth {{api}} {{reason}}")]),
        ("Admission queue", "stat", "short",
         "Requests admitted and waiting for their first token (bounded by --max-queued-requests).",
         [("sum(halfmoon_router_queued_requests)", "queued")]),
    ]),
    ("Prefill", [
        ("Prefill queues", "timeseries", "short", "Requests per prefill stage, all prefill workers.",
         [("sum by (queue) (halfmoon_prefill_queue_requests)", "{{queue}}")]),
        ("Prefill tokens per second", "timeseries", "short",
         "Prompt tokens accepted and the part served from the prefill radix cache.",
         [("sum(rate(halfmoon_prefill_prompt_tokens_total[1m]))", "prompt"),
          ("sum(rate(halfmoon_prefill_cached_tokens_total[1m]))", "cached")]),
        ("Prefill batch size", "timeseries", "short", "Requests per prefill forward batch (quantiles over 1m).",
         quantiles("halfmoon_prefill_batch_size_requests")),
        ("Prefill batch tokens", "timeseries", "short", "Extend tokens per prefill forward batch (quantiles over 1m).",
         quantiles("halfmoon_prefill_batch_tokens")),
        ("Prefill compute busy fraction", "timeseries", "percentunit",
         "Seconds of prefill forward per second, per worker (1 = always computing).",
         [("sum by (instance) (rate(halfmoon_prefill_compute_seconds_sum[1m]))", "{{instance}}")]),
        ("Prefill forward time", "timeseries", "s", "Wall time of one prefill forward batch (quantiles over 1m).",
         quantiles("halfmoon_prefill_compute_seconds")),
    ]),
    ("Transfer", [
        ("KV transfer throughput", "timeseries", "GBs", "KV bytes written to decode workers, GB/s (sender side).",
         [("halfmoon:transfer_bytes:rate1m / 1e9", "GB/s")]),
        ("KV pages transferred", "timeseries", "short", "KV pages written per second (sender side).",
         [("halfmoon:transfer_pages:rate1m", "pages/s")]),
        ("KV pages per rank pair (TP)", "timeseries", "short",
         "Pages submitted per second per (prefill rank, decode rank) under tensor parallelism: each pair "
         "moves its kv-head slice of the page.",
         [("sum by (src_rank, dst_rank) (rate(halfmoon_transfer_rank_pages_total[1m]))", "P{{src_rank}} -> D{{dst_rank}}")]),
        ("Transfer batch latency", "timeseries", "s", "Submit to completion of one transfer batch.",
         [("histogram_quantile(0.5, sum by (le) (rate(halfmoon_transfer_batch_seconds_bucket[1m])))", "p50"),
          ("halfmoon:transfer_batch_seconds:p99_1m", "p99")]),
        ("Transfer failures by reason", "timeseries", "short", "Failed transfer batches per second (5m rate).",
         [("halfmoon:transfer_failures:rate5m", "{{reason}}")]),
    ]),
    ("Decode", [
        ("Decode queues", "timeseries", "short",
         "prealloc: waiting for pages; transfer: waiting for KV; waiting: ready to join the batch; running.",
         [("sum by (queue) (halfmoon_decode_queue_requests)", "{{queue}}"),
          ("sum(halfmoon_decode_running_requests)", "running")]),
        ("Generated tokens per second", "timeseries", "short", "Tokens sampled by decode workers per second.",
         [("sum by (instance) (rate(halfmoon_decode_generated_tokens_total[1m]))", "{{instance}}")]),
        ("KV wait", "timeseries", "s", "Pre-allocation to KV commit, per request (quantiles over 1m).",
         quantiles("halfmoon_decode_kv_wait_seconds")),
        ("Evicted pages per second", "timeseries", "short", "Decode radix-cache pages evicted to make room.",
         [("sum by (instance) (rate(halfmoon_decode_evicted_pages_total[1m]))", "{{instance}}"),
          ("sum by (instance) (rate(halfmoon_decode_kv_checksum_mismatches_total[1m]))",
           "{{instance}} checksum mismatches")]),
        ("Quarantine releases by cause", "timeseries", "short",
         "Quarantined destination rooms released per second (5m): fence_deadline means a prefill worker never answered.",
         [("sum by (cause) (rate(halfmoon_decode_quarantine_releases_total[5m]))", "{{cause}}")]),
    ]),
    ("KV cache", [
        ("Decode KV pool usage", "timeseries", "percentunit",
         "1 - (free + evictable) / total pages, per decode worker.",
         [("max by (instance) (halfmoon_decode_kv_pool_usage_ratio)", "{{instance}}")]),
        ("Decode KV pages by state", "timeseries", "short", "free + evictable + locked + owned = pool size.",
         [("sum by (state) (halfmoon_decode_kv_pool_pages)", "{{state}}")]),
        ("Decode host work per request-step", "timeseries", "s",
         "Seconds of the decode loop's host work (not the device forward) per running request per step, "
         "and the device part, per decode worker: host work that grows with the batch bounds a "
         "served step.",
         [("sum by (instance) (rate(halfmoon_decode_step_seconds_total{part=\"host\"}[1m])) / "
           "sum by (instance) (rate(halfmoon_decode_step_requests_total[1m]))", "host {{instance}}"),
          ("sum by (instance) (rate(halfmoon_decode_step_seconds_total{part=\"device\"}[1m])) / "
           "sum by (instance) (rate(halfmoon_decode_step_requests_total[1m]))", "device {{instance}}")]),
        ("Decode retractions", "timeseries", "short",
         "Per second: running requests retracted when the pool could not grow them (by reason), decode "
         "steps that found the pool short (reserve misses), tokens recomputed on resume.",
         [("sum by (reason) (rate(halfmoon_decode_retractions_total[1m]))", "retracted {{reason}}"),
          ("sum(rate(halfmoon_decode_reserve_misses_total[1m]))", "reserve misses"),
          ("sum(rate(halfmoon_decode_resume_recomputed_tokens_total[1m]))", "recomputed tokens")]),
        ("Decode projected vs owned pages", "timeseries", "short",
         "Pages admission projects the live requests to still take, the pages they own now, the "
         "projection's new-token ratio (x100) and the mean share of max_tokens that finished requests "
         "actually generated (x100, 5m; the ratio learns it).",
         [("sum by (instance) (halfmoon_decode_kv_projected_pages)", "projected {{instance}}"),
          ('sum by (instance) (halfmoon_decode_kv_pool_pages{state="owned"})', "owned {{instance}}"),
          ("100 * max by (instance) (halfmoon_decode_new_token_ratio)", "ratio x100 {{instance}}"),
          ("100 * sum by (instance) (rate(halfmoon_decode_finished_token_share_sum[5m])) / "
           "sum by (instance) (rate(halfmoon_decode_finished_token_share_count[5m]))",
           "finished share x100 {{instance}}")]),
        ("Prefix cache hit rate", "timeseries", "percentunit",
         "Share of prompt tokens served from the radix caches (5m): prefill (not recomputed), decode (not transferred).",
         [("halfmoon:prefill_cache_hit_ratio:rate5m", "prefill"),
          ("halfmoon:decode_prefix_hit_ratio:rate5m", "decode")]),
    ]),
    ("Workers", [
        ("Registered workers", "timeseries", "short", "Live workers in the transfer registry, by role.",
         [("sum by (role) (halfmoon_registry_workers)", "{{role}}")]),
        ("halfmoon processes by role and version", "timeseries", "short",
         "halfmoon_worker_info: one series per process (router, prefill, decode, registry).",
         [("count by (role, version) (halfmoon_worker_info)", "{{role}} {{version}}")]),
        ("Scrape targets up", "timeseries", "short", "Scrape targets up, by job (halfmoon-<role>).",
         [('sum by (job) (up{job=~"halfmoon-.*"})', "{{job}}")]),
        ("Registry lookups and expired leases", "timeseries", "short", "Per second.",
         [("sum by (result) (rate(halfmoon_registry_lookups_total[1m]))", "lookup {{result}}"),
          ("sum(rate(halfmoon_registry_expired_leases_total[1m]))", "expired leases")]),
        ("Torch threads per worker (CPU core sharing)", "timeseries", "short",
         "Torch intra-op threads each worker's forwards run with now; with --cpu-share a busy worker "
         "takes the cores idle ones leave.",
         [("max by (instance) (halfmoon_prefill_torch_threads)", "prefill {{instance}}"),
          ("max by (instance) (halfmoon_decode_torch_threads)", "decode {{instance}}")]),
    ]),
]


def _panel(pid: int, title: str, kind: str, unit: str, desc: str, queries, x: int, y: int) -> dict:
    targets = [{"datasource": DS, "expr": expr, "legendFormat": legend, "range": True,
                "refId": chr(ord("A") + i)} for i, (expr, legend) in enumerate(queries)]
    panel = {
        "datasource": DS, "description": desc, "id": pid, "title": title, "type": kind,
        "gridPos": {"h": 8, "w": 8 if kind == "timeseries" else 4, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": targets,
    }
    if kind == "timeseries":
        panel["options"] = {"legend": {"calcs": [], "displayMode": "list", "placement": "bottom",
                                       "showLegend": True},
                            "tooltip": {"mode": "multi", "sort": "none"}}
    else:
        panel["options"] = {"colorMode": "value", "graphMode": "area", "justifyMode": "auto",
                            "orientation": "auto", "textMode": "auto", "wideLayout": True,
                            "showPercentChange": False, "percentChangeColorMode": "standard",
                            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
    return panel


def build() -> dict:
    panels, pid, y = [], 1, 0
    for row_title, row_panels in ROWS:
        panels.append({"collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "id": pid,
                       "panels": [], "title": row_title, "type": "row"})
        pid, y, x = pid + 1, y + 1, 0
        for title, kind, unit, desc, queries in row_panels:
            width = 8 if kind == "timeseries" else 4
            if x + width > 24:
                x, y = 0, y + 8
            panels.append(_panel(pid, title, kind, unit, desc, queries, x, y))
            pid, x = pid + 1, x + width
        y += 8
    return {
        "annotations": {"list": []},
        "description": "halfmoon prefill/decode disaggregated serving: router, prefill, transfer, decode, KV cache.",
        "editable": True,
        "graphTooltip": 1,
        "links": [],
        "panels": panels,
        "refresh": "10s",
        "schemaVersion": 39,
        "tags": ["halfmoon", "llm"],
        "templating": {"list": [{
            "hide": 0, "includeAll": False, "label": "Prometheus", "multi": False,
            "name": "datasource", "options": [], "query": "prometheus", "refresh": 1, "regex": "",
            "type": "datasource"}]},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": "halfmoon",
        "uid": "halfmoon-overview",
        "version": 1,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


if __name__ == "__main__":
    text = render()
    for path in (OUT, CHART_COPY):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}", file=sys.stderr)
