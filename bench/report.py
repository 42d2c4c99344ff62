"""Human-readable tables of a ``bench serve`` result, and side-by-side comparison of several results.

Layout after vLLM's ``benchmark_serving`` summary: one headline block, then one block per latency
(mean, p50, p90, p99 in milliseconds), then cache and KV-transfer figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

WIDTH = 60
LATENCIES = (("ttft_ms", "Time to first token"), ("itl_ms", "Inter-token latency"),
             ("tpot_ms", "Time per output token (excl. 1st)"), ("e2e_ms", "End-to-end latency"))


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def _row(label: str, value: Any, digits: int = 2) -> str:
    return f"{label + ':':<44}{_fmt(value, digits):>{WIDTH - 44}}"


def _title(text: str, fill: str = "-") -> str:
    return f" {text} ".center(WIDTH, fill)


def summary_table(result: dict[str, Any]) -> str:
    """The text table of one result dict (as written by ``bench serve``)."""
    s = result["summary"]
    cfg = result["config"]
    lines = [_title("halfmoon bench serve", "="),
             _row("Target", f"{cfg['target']} {cfg.get('endpoint', '')}".strip()),
             _row("Workload", cfg["workload"]),
             _row("Load", cfg["load"]),
             _row("Host load average (1 min, before/after)",
                  f"{cfg['host']['loadavg_1m_before']:.1f} / {cfg['host']['loadavg_1m_after']:.1f}"
                  f" on {cfg['host']['cpus']} CPUs" if cfg.get("host") else None),
             _row("Successful requests", s["completed"]),
             _row("Errors", s["errors"]),
             _row("Benchmark duration (s)", s["duration_s"]),
             _row("Request throughput (req/s)", s["request_throughput"], 3),
             _row("Input token throughput (tok/s)", s["input_tokens_per_s"]),
             _row("Output token throughput (tok/s)", s["output_tokens_per_s"]),
             _row("Total input tokens", s["tokens"]["input"]),
             _row("Total output tokens", s["tokens"]["output"])]
    g = s["goodput"]
    slo = ", ".join(f"{k}<={v:g}" for k, v in g["slo"].items() if v is not None) or "none"
    lines += [_row(f"Goodput (req/s) [SLO {slo}]", g["requests_per_s"], 3),
              _row("Requests meeting the SLO (%)", 100.0 * g["fraction"], 1)]
    for key, name in LATENCIES:
        d = s[key]
        lines.append(_title(f"{name} (ms)"))
        for stat in ("mean", "p50", "p90", "p99"):
            lines.append(_row(f"{stat.upper() if stat != 'mean' else 'Mean'} {key.split('_')[0].upper()}", d[stat]))
    lines.append(_title("Cache and KV transfer"))
    t, kv = s["tokens"], s["kv_usage"]
    lines += [_row("Cached prompt tokens (usage)", t["cached"]),
              _row("Decode prefix tokens (usage)", t["decode_prefix"]),
              _row("KV pages moved per request (usage)", kv["pages_per_request"]),
              _row("KV bytes moved per request (usage)", kv["bytes_per_request"], 0)]
    m = result.get("metrics")
    if m and m.get("kv"):
        k = m["kv"]
        lines += [_row("KV pages moved per request (/metrics)", k["kv_pages_per_request"]),
                  _row("KV bytes moved per request (/metrics)", k["kv_bytes_per_request"], 0),
                  _row("Prefill cached tokens (/metrics)", k["prefill_cached_tokens"], 0),
                  _row("Decode prefix-hit tokens (/metrics)", k["decode_prefix_hit_tokens"], 0),
                  _row("Transfer failures (/metrics)", k["transfer_failures"], 0)]
    if s["error_examples"]:
        lines.append(_title("Errors (examples)"))
        lines += [f"  {e[:WIDTH - 2]}" for e in s["error_examples"]]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


COMPARE_ROWS = (
    ("request_throughput", "req/s", True), ("output_tokens_per_s", "output tok/s", True),
    ("input_tokens_per_s", "input tok/s", True), ("ttft_ms.p50", "TTFT p50 ms", False),
    ("ttft_ms.p99", "TTFT p99 ms", False), ("itl_ms.p50", "ITL p50 ms", False),
    ("tpot_ms.p50", "TPOT p50 ms", False), ("tpot_ms.p99", "TPOT p99 ms", False),
    ("e2e_ms.p50", "E2E p50 ms", False), ("goodput.requests_per_s", "goodput req/s", True),
    ("errors", "errors", False),
)


def _get(d: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def compare_table(results: Sequence[dict[str, Any]], names: Sequence[str]) -> str:
    """Results side by side; the last column is ``first / second`` (higher-is-better rows) or
    ``second / first`` (latencies), so a ratio above 1 always means the first is better."""
    if len(results) < 2:
        raise ValueError("compare needs at least two results")
    cols = list(names)
    width = max(14, *(len(n) + 2 for n in cols))
    head = f"{'metric':<18}" + "".join(f"{n:>{width}}" for n in cols) + f"{'1st vs 2nd':>{width}}"
    lines = [head, "-" * len(head)]
    for path, label, higher_better in COMPARE_ROWS:
        vals = [_get(r["summary"], path) for r in results]
        a, b = vals[0], vals[1]
        ratio = None
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a and b:
            ratio = a / b if higher_better else b / a
        lines.append(f"{label:<18}" + "".join(f"{_fmt(v):>{width}}" for v in vals) + f"{_fmt(ratio):>{width}}")
    return "\n".join(lines)
