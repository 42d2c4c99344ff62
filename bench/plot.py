"""``bench serve --plot``: one PNG with latency CDFs (TTFT, ITL, TPOT, E2E) and throughput over time.

Needs matplotlib (the ``bench`` extra: ``pip install 'halfmoon[bench]'``); the Agg backend, no display.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bench.request import RequestRecord
from bench.stats import itl_gaps, tpot


def _cdf(ax, values_ms: list[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests" if "ITL" not in title else "fraction of tokens")
    ax.grid(alpha=0.3)
    if not values_ms:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    x = np.sort(np.asarray(values_ms))
    ax.step(np.concatenate([x[:1], x]), np.arange(0, x.size + 1) / x.size, where="post")
    for p in (50, 90, 99):
        ax.axvline(np.percentile(x, p), ls=":", lw=0.8, color="gray")


def write_plot(path: str | Path, records: list[RequestRecord], timeline: list[dict[str, float]],
               title: str) -> Path:
    """Write the figure to ``path`` (PNG) and return it.

    Args:
        records: the measured requests (failed ones are left out).
        timeline: :func:`bench.stats.timeline` bins.
        title: figure title (target, workload, load).

    Raises:
        ImportError: matplotlib is not installed (``pip install 'halfmoon[bench]'``).
    """
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the extra
        raise ImportError("--plot needs matplotlib: pip install 'halfmoon[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.ok]
    ttft = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    itl = [g * 1e3 for r in ok for g in itl_gaps(r.chunk_times, r.chunk_tokens)]
    tp = [t * 1e3 for r in ok if (t := tpot(r.chunk_times, r.output_tokens)) is not None]
    e2e = [r.e2e * 1e3 for r in ok]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    _cdf(axes[0, 0], ttft, "TTFT CDF")
    _cdf(axes[0, 1], itl, "ITL CDF")
    _cdf(axes[0, 2], tp, "TPOT CDF")
    _cdf(axes[1, 0], e2e, "E2E latency CDF")
    t = [b["t"] for b in timeline]
    ax = axes[1, 1]
    ax.plot(t, [b["output_tokens_per_s"] for b in timeline], drawstyle="steps-post")
    ax.set_title("output throughput over time")
    ax.set_xlabel("s since start")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    ax = axes[1, 2]
    ax.plot(t, [b["requests_per_s"] for b in timeline], drawstyle="steps-post", color="tab:green")
    ax.set_title("completed requests over time")
    ax.set_xlabel("s since start")
    ax.set_ylabel("requests/s")
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_from_result(path: str | Path, result: dict[str, Any]) -> Path:
    """Re-plot from a saved JSON result that kept its per-request records."""
    recs = []
    for d in result.get("requests", []):
        r = RequestRecord(ok=d["ok"], start=d["start"], end=d["end"], chunk_times=d["chunk_times"],
                          chunk_tokens=d["chunk_tokens"], completion_tokens=d["completion_tokens"])
        recs.append(r)
    return write_plot(path, recs, result["timeline"], result["config"]["workload"])
