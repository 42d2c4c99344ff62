"""One table (and JSON) of the key figures of several `halfmoon bench serve` result files.

    python -m bench.serve_summary RESULT.json ... [--out summary.json]
"""

from __future__ import annotations

import argparse
import json
import sys


def row(path: str) -> dict:
    d = json.load(open(path))
    s = d["summary"]
    return {"label": d.get("config", {}).get("label") or path, "requests": s["completed"], "errors": s["errors"],
            "req_per_s": s["request_throughput"], "out_tok_per_s": s["output_tokens_per_s"],
            "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "itl_mean_ms": s["itl_ms"]["mean"], "itl_p99_ms": s["itl_ms"]["p99"],
            "tpot_mean_ms": s["tpot_ms"]["mean"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    rows = [row(f) for f in a.results]
    cols = list(rows[0])
    print(" ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print(" ".join(f"{v:>14.2f}" if isinstance(v, float) else f"{v!s:>14}" for v in r.values()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
